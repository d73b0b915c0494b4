"""lightning_fedshard: FL+FSDP / FL+HSDP strategies for PyTorch Lightning, and Llama 3.1 pre-training on them.

Importing the package registers the strategy names ``"fl_fsdp"``, ``"fl_hsdp"``, ``"fsdp2"``, ``"hsdp"`` and
``"ddp_dynamiq"`` with Lightning (at once if ``lightning.pytorch`` is imported, else when it is); the public names
load on first use, so ``import lightning_fedshard.verify`` never imports Lightning. ``lightning_fedshard.dynamiq``
holds the compressed collectives and the ``DynamiQ`` plugin; ``lightning_fedshard.verify`` the neural-network
verifier (``verify_files(onnx, vnnlib, VerifyConfig())``); ``lightning_fedshard.optim`` the structure-aware
optimizers ``Muon`` and ``AdamW8bit`` and the block-aligned shard planner ``BlockShardPlan``;
``lightning_fedshard.bench.costmodel`` the communication and time cost of a training step
(``step_time(Workload.for_llama(...), LEONARDO)``).
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType

# Every public name, and the module it comes from: loaded on first use (PEP 562), so that ``fedshard verify`` and
# ``import lightning_fedshard.verify`` pay for torch and onnx only, not for Lightning, datasets and the training stack.
_EXPORTS = {
    "TextDataModule": "lightning_fedshard.data",
    "DynamiQ": "lightning_fedshard.dynamiq",
    "PRESETS": "lightning_fedshard.models",
    "Llama": "lightning_fedshard.models",
    "LlamaConfig": "lightning_fedshard.models",
    "export_hf": "lightning_fedshard.models.hf_export",
    "AdamW8bit": "lightning_fedshard.optim",
    "BlockShardPlan": "lightning_fedshard.optim",
    "Muon": "lightning_fedshard.optim",
    "STRATEGY_NAMES": "lightning_fedshard.strategies",
    "CommLedger": "lightning_fedshard.strategies",
    "DynamiQDDPStrategy": "lightning_fedshard.strategies",
    "FaultTolerance": "lightning_fedshard.strategies",
    "FedShardDims": "lightning_fedshard.strategies",
    "FLFSDPStrategy": "lightning_fedshard.strategies",
    "FLHSDPStrategy": "lightning_fedshard.strategies",
    "FLOptions": "lightning_fedshard.strategies",
    "FragmentSchedule": "lightning_fedshard.strategies",
    "partition_fragments": "lightning_fedshard.strategies",
    "register_strategies": "lightning_fedshard.strategies",
    "LlamaPretraining": "lightning_fedshard.training",
    "TokenThroughputMonitor": "lightning_fedshard.training",
    "ShardPlan": "lightning_fedshard.verify",
    "Verdict": "lightning_fedshard.verify",
    "VerificationModule": "lightning_fedshard.verify",
    "VerificationResult": "lightning_fedshard.verify",
    "VerifyConfig": "lightning_fedshard.verify",
    "VnncompInstances": "lightning_fedshard.verify",
    "load_onnx": "lightning_fedshard.verify",
    "read_vnnlib": "lightning_fedshard.verify",
    "verify_files": "lightning_fedshard.verify",
}
_SUBPACKAGES = frozenset(
    {"bench", "cli", "compat", "data", "distributed", "dynamiq", "models", "optim", "strategies", "training", "verify"}
)


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later look-ups skip this hook
        return value
    if name in _SUBPACKAGES:  # ``lightning_fedshard.strategies`` after a bare ``import lightning_fedshard``
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBPACKAGES)


def _register_on_first_lookup() -> None:
    """Makes Lightning's strategy registry import :mod:`lightning_fedshard.strategies` (which registers the names)
    the first time anyone looks a name up, so that ``Trainer(strategy="fl_hsdp")`` works after
    ``import lightning_fedshard``.

    Registering at once would import the training stack into every process that imports Lightning, at a point where
    one of this package's own modules may be half imported (the one that imported Lightning); a look-up comes later,
    from a Trainer, LightningCLI or a worker reading ``StrategyRegistry[name]``.
    """
    from lightning.pytorch.strategies import StrategyRegistry

    registry_type = type(StrategyRegistry)

    class _RegistersOnFirstLookup(registry_type):
        def _register(self) -> None:
            self.__class__ = registry_type
            importlib.import_module("lightning_fedshard.strategies")

        def __contains__(self, name: object) -> bool:
            self._register()
            return name in self

        def __getitem__(self, name: str) -> dict:
            self._register()
            return self[name]

        def __iter__(self) -> Iterator[str]:
            self._register()
            return iter(self)

        def get(self, name: str, default: object = None) -> object:
            self._register()
            return self.get(name, default)

        def available_strategies(self) -> list[str]:
            self._register()
            return self.available_strategies()

    if type(StrategyRegistry) is registry_type and not {"fl_fsdp", "fl_hsdp"} <= dict.keys(StrategyRegistry):
        StrategyRegistry.__class__ = _RegistersOnFirstLookup


class _AfterLightningImport(importlib.abc.MetaPathFinder):
    """Calls :func:`_register_on_first_lookup` as soon as ``lightning.pytorch`` finishes importing: a verification
    process never imports Lightning, so it never pays for it. Wraps the spec the path finder gives for
    ``lightning.pytorch`` once, then leaves ``sys.meta_path``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "lightning.pytorch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            _register_on_first_lookup()

        spec.loader.exec_module = exec_then_register
        return spec


if "lightning.pytorch" in sys.modules:
    _register_on_first_lookup()
elif not any(isinstance(finder, _AfterLightningImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AfterLightningImport())

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "STRATEGY_NAMES",
    "AdamW8bit",
    "BlockShardPlan",
    "CommLedger",
    "DynamiQ",
    "DynamiQDDPStrategy",
    "FLFSDPStrategy",
    "FLHSDPStrategy",
    "FLOptions",
    "FaultTolerance",
    "FedShardDims",
    "FragmentSchedule",
    "Llama",
    "LlamaConfig",
    "LlamaPretraining",
    "Muon",
    "ShardPlan",
    "TextDataModule",
    "TokenThroughputMonitor",
    "Verdict",
    "VerificationModule",
    "VerificationResult",
    "VerifyConfig",
    "VnncompInstances",
    "__version__",
    "export_hf",
    "load_onnx",
    "partition_fragments",
    "read_vnnlib",
    "verify_files",
]
