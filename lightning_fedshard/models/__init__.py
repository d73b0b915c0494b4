"""Model definitions; none of them imports torch.distributed."""

from lightning_fedshard.models.config import PRESETS, LlamaConfig, RopeScaling
from lightning_fedshard.models.llama import Llama, TransformerBlock

__all__ = ["PRESETS", "Llama", "LlamaConfig", "RopeScaling", "TransformerBlock"]
