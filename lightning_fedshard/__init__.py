"""lightning_fedshard: FL+FSDP / FL+HSDP strategies for PyTorch Lightning, and Llama 3.1 pre-training on them.

Importing the package registers the strategy names ``"fl_fsdp"``, ``"fl_hsdp"``, ``"fsdp2"``, ``"hsdp"`` and
``"ddp_dynamiq"``; ``lightning_fedshard.dynamiq`` holds the compressed collectives and the ``DynamiQ`` plugin;
``lightning_fedshard.verify`` the neural-network verifier (``verify_files(onnx, vnnlib, VerifyConfig())``);
``lightning_fedshard.optim`` the structure-aware optimizers ``Muon`` and ``AdamW8bit`` and the block-aligned shard planner
``BlockShardPlan``; ``lightning_fedshard.bench.costmodel`` the communication and time cost of a training step
(``step_time(Workload.for_llama(...), LEONARDO)``).
"""

from lightning_fedshard.data import TextDataModule
from lightning_fedshard.dynamiq import DynamiQ
from lightning_fedshard.models import PRESETS, Llama, LlamaConfig
from lightning_fedshard.optim import AdamW8bit, BlockShardPlan, Muon
from lightning_fedshard.strategies import (
    STRATEGY_NAMES,
    CommLedger,
    DynamiQDDPStrategy,
    FaultTolerance,
    FedShardDims,
    FLFSDPStrategy,
    FLHSDPStrategy,
    FragmentSchedule,
    partition_fragments,
    register_strategies,
)
from lightning_fedshard.training import LlamaPretraining, TokenThroughputMonitor

# The verifier (and onnx with it, ~1 s per process) loads on first use: training processes never need it.
_VERIFY_EXPORTS = frozenset(
    {
        "ShardPlan",
        "Verdict",
        "VerificationModule",
        "VerificationResult",
        "VerifyConfig",
        "VnncompInstances",
        "load_onnx",
        "read_vnnlib",
        "verify_files",
    }
)


def __getattr__(name: str) -> object:
    if name in _VERIFY_EXPORTS:
        from lightning_fedshard import verify

        return getattr(verify, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register_strategies()

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "AdamW8bit",
    "BlockShardPlan",
    "STRATEGY_NAMES",
    "CommLedger",
    "DynamiQ",
    "DynamiQDDPStrategy",
    "FLFSDPStrategy",
    "FLHSDPStrategy",
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
    "load_onnx",
    "partition_fragments",
    "read_vnnlib",
    "verify_files",
]
