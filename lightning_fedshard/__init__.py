"""lightning_fedshard: FL+FSDP / FL+HSDP strategies for PyTorch Lightning, and Llama 3.1 pre-training on them.

Importing the package registers the strategy names ``"fl_fsdp"``, ``"fl_hsdp"``, ``"fsdp2"`` and ``"hsdp"``.
"""

from lightning_fedshard.data import TextDataModule
from lightning_fedshard.models import PRESETS, Llama, LlamaConfig
from lightning_fedshard.strategies import (
    STRATEGY_NAMES,
    CommLedger,
    FedShardDims,
    FLFSDPStrategy,
    FLHSDPStrategy,
    register_strategies,
)
from lightning_fedshard.training import LlamaPretraining, TokenThroughputMonitor

register_strategies()

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "STRATEGY_NAMES",
    "CommLedger",
    "FLFSDPStrategy",
    "FLHSDPStrategy",
    "FedShardDims",
    "Llama",
    "LlamaConfig",
    "LlamaPretraining",
    "TextDataModule",
    "TokenThroughputMonitor",
    "__version__",
]
