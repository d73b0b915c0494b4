"""FL+FSDP and FL+HSDP Lightning strategies and the pieces they are built from."""

from lightning_fedshard.strategies.ddp_dynamiq import DynamiQDDPStrategy
from lightning_fedshard.strategies.dims import FedShardDims
from lightning_fedshard.strategies.fault_tolerance import FaultTolerance
from lightning_fedshard.strategies.fl_fsdp import FLFSDPStrategy
from lightning_fedshard.strategies.fl_hsdp import FLHSDPStrategy
from lightning_fedshard.strategies.fl_options import FLOptions
from lightning_fedshard.strategies.ledger import CommLedger
from lightning_fedshard.strategies.registry import STRATEGY_NAMES, register_strategies
from lightning_fedshard.strategies.streaming import FragmentSchedule, StreamingSync, partition_fragments

__all__ = [
    "STRATEGY_NAMES",
    "CommLedger",
    "DynamiQDDPStrategy",
    "FLFSDPStrategy",
    "FLHSDPStrategy",
    "FLOptions",
    "FaultTolerance",
    "FedShardDims",
    "FragmentSchedule",
    "StreamingSync",
    "partition_fragments",
    "register_strategies",
]

# Importing the strategies registers their names (``Trainer(strategy="fl_hsdp")``); the package root arranges this
# import on Lightning's first registry look-up.
register_strategies()
