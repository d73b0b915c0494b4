"""String names for the strategies, so that ``Trainer(strategy="fl_hsdp")`` and LightningCLI YAML work."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_fedshard.compat import _StrategyRegistry
from lightning_fedshard.strategies.ddp_dynamiq import DynamiQDDPStrategy
from lightning_fedshard.strategies.fl_fsdp import FLFSDPStrategy
from lightning_fedshard.strategies.fl_hsdp import FLHSDPStrategy

__all__ = ["STRATEGY_NAMES", "register_strategies"]

# name -> (class, preset arguments, description); the baselines run the same code with one group.
_STRATEGIES = {
    "fl_fsdp": (FLFSDPStrategy, {}, "FL+FSDP: federation groups of FSDP2, parameter shards averaged every few steps"),
    "fl_hsdp": (FLHSDPStrategy, {}, "FL+HSDP: federation groups of HSDP, parameter shards averaged every few steps"),
    "fsdp2": (FLFSDPStrategy, {"num_groups": 1}, "FSDP2 over all ranks (the fl_fsdp code path with one group)"),
    "hsdp": (FLHSDPStrategy, {"num_groups": 1}, "HSDP over all ranks (the fl_hsdp code path with one group)"),
    "ddp_dynamiq": (DynamiQDDPStrategy, {}, "DDP whose gradient all-reduce is DynamiQ's compressed ring (5 bits)"),
}
STRATEGY_NAMES = tuple(_STRATEGIES)


def register_strategies(registry: _StrategyRegistry = StrategyRegistry) -> None:
    """Adds the names to Lightning's registry; names already present (a second import) are left alone."""
    for name, (cls, preset, description) in _STRATEGIES.items():
        if name not in registry:
            registry.register(name, cls, description=description, **preset)
