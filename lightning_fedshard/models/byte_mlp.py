"""A small byte-level language model that trains in seconds on CPU; knows nothing about distribution."""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["ByteMLPLM", "ResidualMLPBlock"]

VOCAB = 256


class ResidualMLPBlock(nn.Module):
    """Pre-norm residual MLP; the unit FSDP shards one at a time (``auto_wrap``)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ByteMLPLM(nn.Module):
    """Predicts the next byte from the last ``context`` bytes: a causal convolution mixes the context, then
    residual MLP blocks.

    Example::

        model = ByteMLPLM(dim=64, depth=2)
        logits = model(torch.randint(0, 256, (4, 32)))  # (4, 32, 256)
    """

    def __init__(self, dim: int = 128, depth: int = 4, context: int = 8) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(VOCAB, dim)
        self.mix = nn.Conv1d(dim, dim, kernel_size=context, groups=dim)
        self.blocks = nn.ModuleList(ResidualMLPBlock(dim, 4 * dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens).transpose(1, 2)  # (batch, dim, seq)
        x = self.mix(F.pad(x, (self.context - 1, 0))).transpose(1, 2)  # left padding keeps it causal
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
