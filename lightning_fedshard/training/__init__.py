"""Llama 3.1 pre-training as a LightningModule, its schedule and its throughput callback."""

from lightning_fedshard.training.pretraining import LlamaPretraining
from lightning_fedshard.training.schedule import warmup_cosine
from lightning_fedshard.training.throughput import TokenThroughputMonitor

__all__ = ["LlamaPretraining", "TokenThroughputMonitor", "warmup_cosine"]
