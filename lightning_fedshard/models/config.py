"""Llama 3.1 shapes as a frozen dataclass, with named presets (``LlamaConfig.from_name("llama3.1-8b")``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PRESETS", "LlamaConfig", "RopeScaling"]


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling: long wavelengths are stretched by ``factor``, short ones kept,
    and a smooth blend in between (``low_freq_factor`` and ``high_freq_factor`` bound the band)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    """Context length the unscaled frequencies were trained for."""


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of one Llama 3.1 model. Derived fields are filled in ``__post_init__``.

    Example::

        config = LlamaConfig.from_name("llama3.1-8b")
        small = LlamaConfig.from_name("llama3.1-tiny", n_layers=2)
    """

    name: str = "custom"
    vocab_size: int = 128256
    dim: int = 4096
    """Width of the residual stream."""
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    """Key/value heads shared by groups of ``n_heads // n_kv_heads`` query heads (grouped-query attention)."""
    ffn_dim: int = 14336
    """Hidden width of the SwiGLU feed-forward block."""
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    max_seq_len: int = 131072
    """Longest sequence the rotary embedding is meant for (the model's context)."""
    head_dim: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig {self.name!r}: `{name}` must be a positive integer, got {value!r}.")
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig {self.name!r}: dim={self.dim} is not divisible by n_heads={self.n_heads}.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig {self.name!r}: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}."
            )
        head_dim = self.dim // self.n_heads
        if head_dim % 2:
            raise ValueError(f"LlamaConfig {self.name!r}: the head size {head_dim} must be even for rotary embeddings.")
        object.__setattr__(self, "head_dim", head_dim)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> LlamaConfig:
        """The preset ``name`` (see :data:`PRESETS`), with any field replaced by ``overrides``."""
        if name not in PRESETS:
            raise ValueError(f"Unknown Llama preset {name!r}; known presets: {', '.join(PRESETS)}.")
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls) if f.init}
        if unknown:
            raise ValueError(f"LlamaConfig has no fields {sorted(unknown)}; cannot override them on {name!r}.")
        if isinstance(overrides.get("rope_scaling"), dict):
            overrides["rope_scaling"] = RopeScaling(**overrides["rope_scaling"])
        return dataclasses.replace(PRESETS[name], **overrides)

    @property
    def num_parameters(self) -> int:
        """Exact parameter count (untied input embedding and output head)."""
        kv_dim = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv_dim
        block = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim
        return self.n_layers * block + 2 * self.vocab_size * self.dim + self.dim

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token: 6 per weight of every matrix multiply, plus the
        attention scores and their weighted sum over the whole ``seq_len`` (PaLM's convention, no causal
        discount). The input embedding is a lookup and costs nothing."""
        matmul_weights = self.num_parameters - self.vocab_size * self.dim - (2 * self.n_layers + 1) * self.dim
        return 6 * matmul_weights + 12 * self.n_layers * self.dim * seq_len


#: Named shapes. The 8B is Meta's Llama 3.1 8B (huggingface.co/meta-llama/Llama-3.1-8B, config.json);
#: the 1B takes Llama 3.2 1B's shapes with an untied head; the tiny ones train on two CPU cores with
#: the byte tokenizer (256 bytes + end-of-text). The tiny ones have plain RoPE: Llama 3.1's scaling stretches a
#: model trained on 8,192 tokens to 128K, which says nothing about a model trained from scratch on at most 1,024
#: (and `transformers` warns on loading a config whose original context is not below its maximum).
PRESETS: dict[str, LlamaConfig] = {
    "llama3.1-8b": LlamaConfig(name="llama3.1-8b"),
    "llama3.1-1b": LlamaConfig(name="llama3.1-1b", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192),
    "llama3.1-tiny": LlamaConfig(
        name="llama3.1-tiny",
        vocab_size=257,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=384,
        rope_scaling=None,
        max_seq_len=1024,
    ),
    "llama3.1-micro": LlamaConfig(
        name="llama3.1-micro",
        vocab_size=257,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        rope_scaling=None,
        max_seq_len=256,
    ),
}
