"""A GPT-2-style decoder (learned positions, pre-LayerNorm blocks, GELU MLP, output head tied to the token
embedding): a second transformer family next to Llama 3.1, whose gradients differ (tied embeddings get two
gradient sources, LayerNorm has biases). No distributed code."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT2", "GPT2_PRESETS", "GPT2Config"]


@dataclass(frozen=True)
class GPT2Config:
    """Shapes of a GPT-2-style model.

    Example::

        config = GPT2Config.from_name("gpt2-tiny", n_layers=2)
    """

    name: str = "gpt2-tiny"
    vocab_size: int = 257
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 256
    norm_eps: float = 1e-5

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, as ``LlamaConfig.flops_per_token`` counts them: 6 per matrix weight (the
        tied head included, the embeddings' lookups not) plus attention over ``seq_len``."""
        matmul_weights = 12 * self.n_layers * self.dim**2 + self.vocab_size * self.dim
        return 6 * matmul_weights + 12 * self.n_layers * self.dim * seq_len

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPT2Config:
        if name not in GPT2_PRESETS:
            raise ValueError(f"Unknown GPT-2 preset {name!r}; known presets: {', '.join(GPT2_PRESETS)}.")
        return dataclasses.replace(GPT2_PRESETS[name], **overrides)


GPT2_PRESETS: dict[str, GPT2Config] = {
    "gpt2-tiny": GPT2Config(),
    "gpt2-124m": GPT2Config(name="gpt2-124m", vocab_size=50257, dim=768, n_layers=12, n_heads=12, max_seq_len=1024),
}


class _Block(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.attention_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.mlp_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.fc = nn.Linear(config.dim, 4 * config.dim)
        self.out = nn.Linear(4 * config.dim, config.dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.out(F.gelu(self.fc(self.mlp_norm(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2-style language model: ``tokens [B, T] -> logits [B, T, vocab]``.

    Example::

        model = GPT2(GPT2Config.from_name("gpt2-tiny"))
        logits = model(torch.randint(0, 257, (2, 64)))
    """

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings = nn.Embedding(config.max_seq_len, config.dim)
        self.layers = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers), zero biases."""
        for name, parameter in self.named_parameters():
            if parameter.dim() == 1:
                nn.init.ones_(parameter) if "norm" in name and name.endswith("weight") else nn.init.zeros_(parameter)
            else:
                std = 0.02 / (2 * self.config.n_layers) ** 0.5 if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(parameter, std=std)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds max_seq_len={self.config.max_seq_len}.")
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) @ self.tok_embeddings.weight.T  # tied output head
