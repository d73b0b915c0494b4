"""Model definitions; none of them imports torch.distributed."""

from lightning_fedshard.models.byte_mlp import ByteMLPLM, ResidualMLPBlock

__all__ = ["ByteMLPLM", "ResidualMLPBlock"]
