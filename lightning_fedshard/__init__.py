"""lightning_fedshard: FL+FSDP / FL+HSDP strategies for PyTorch Lightning.

Importing the package registers the strategy names ``"fl_fsdp"``, ``"fl_hsdp"``, ``"fsdp2"`` and ``"hsdp"``.
"""

from lightning_fedshard.strategies import (
    STRATEGY_NAMES,
    CommLedger,
    FedShardDims,
    FLFSDPStrategy,
    FLHSDPStrategy,
    register_strategies,
)

register_strategies()

__version__ = "0.1.0"

__all__ = ["CommLedger", "FLFSDPStrategy", "FLHSDPStrategy", "FedShardDims", "STRATEGY_NAMES", "__version__"]
