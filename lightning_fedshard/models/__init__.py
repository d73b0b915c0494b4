"""Model definitions; none of them imports torch.distributed."""

from lightning_fedshard.models.config import PRESETS, LlamaConfig, RopeScaling
from lightning_fedshard.models.gpt2 import GPT2, GPT2_PRESETS, GPT2Config
from lightning_fedshard.models.llama import Llama, TransformerBlock

__all__ = ["GPT2", "GPT2_PRESETS", "PRESETS", "GPT2Config", "Llama", "LlamaConfig", "RopeScaling", "TransformerBlock"]
