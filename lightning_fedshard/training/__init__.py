"""Llama 3.1 pre-training as a LightningModule, its schedule and its throughput and optimizer-state callbacks."""

from lightning_fedshard.training.optimizer_state import OptimizerStateMonitor, optimizer_state_bytes
from lightning_fedshard.training.pretraining import LlamaPretraining
from lightning_fedshard.training.schedule import warmup_cosine
from lightning_fedshard.training.throughput import TokenThroughputMonitor

__all__ = [
    "LlamaPretraining",
    "OptimizerStateMonitor",
    "TokenThroughputMonitor",
    "optimizer_state_bytes",
    "warmup_cosine",
]
