"""The Llama 3.1 architecture: RMSNorm, scaled rotary embeddings, grouped-query attention, SwiGLU.

Knows nothing about distribution: the strategies shard it (one FSDP2 unit per :class:`TransformerBlock`).
Every module that owns tensors has ``reset_parameters()``, so a model built on the meta device is
initialised after sharding, one shard per rank, never whole in one process.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_fedshard.models.config import LlamaConfig, RopeScaling

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "RMSNorm",
    "RotaryEmbedding",
    "TransformerBlock",
    "apply_rotary",
    "rotary_frequencies",
    "scale_frequencies",
]


def rotary_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> Tensor:
    """Angular frequency of each rotated pair, ``theta ** (-2i / head_dim)``, scaled (float32, ``head_dim // 2``)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (freqs if scaling is None else scale_frequencies(freqs, scaling)).float()


def scale_frequencies(freqs: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama 3.1's scaling: wavelengths shorter than ``original_max_position / high_freq_factor`` are kept,
    those longer than ``original_max_position / low_freq_factor`` are stretched by ``factor``, and the band
    in between blends the two linearly in ``original_max_position / wavelength``."""
    wavelength = 2 * math.pi / freqs
    smooth = (scaling.original_max_position / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    long_edge = scaling.original_max_position / scaling.low_freq_factor
    short_edge = scaling.original_max_position / scaling.high_freq_factor
    return torch.where(
        wavelength < short_edge, freqs, torch.where(wavelength > long_edge, freqs / scaling.factor, blended)
    )


class RotaryEmbedding(nn.Module):
    """Rotation angles for positions ``0 .. seq_len-1`` as unit complex numbers, in float32 whatever the
    compute dtype (low-precision angles would blur positions in long sequences)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", torch.empty(config.head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        c = self.config
        with torch.device(self.inv_freq.device):
            self.inv_freq.copy_(rotary_frequencies(c.head_dim, c.rope_theta, c.rope_scaling))

    def forward(self, seq_len: int) -> Tensor:
        positions = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq)
        return torch.polar(torch.ones_like(angles), angles)  # (seq_len, head_dim // 2), complex64


def apply_rotary(x: Tensor, rotation: Tensor) -> Tensor:
    """Rotates consecutive pairs ``(x[..., 2i], x[..., 2i+1])`` of ``x`` (batch, seq, heads, head_dim) by
    ``rotation`` (seq, head_dim // 2), the pairing of Meta's reference implementation."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    rotated = torch.view_as_real(pairs * rotation[None, :, None, :]).flatten(-2)
    return rotated.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).type_as(x)


class _Linear(nn.Linear):
    """Bias-free linear layer initialised from a truncated normal (±3σ) with a chosen σ."""

    def __init__(self, in_features: int, out_features: int, init_std: float) -> None:
        self.init_std = init_std  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        std = self.init_std
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Attention(nn.Module):
    """Causal grouped-query self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, config: LlamaConfig, out_std: float) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        kv_dim = config.n_kv_heads * config.head_dim
        self.wq = _Linear(config.dim, config.dim, 0.02)
        self.wk = _Linear(config.dim, kv_dim, 0.02)
        self.wv = _Linear(config.dim, kv_dim, 0.02)
        self.wo = _Linear(config.dim, config.dim, out_std)

    def forward(self, x: Tensor, rotation: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        q = apply_rotary(self.wq(x).view(batch, seq, self.n_heads, self.head_dim), rotation)
        k = apply_rotary(self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim), rotation)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: LlamaConfig, out_std: float) -> None:
        super().__init__()
        self.w1 = _Linear(config.dim, config.ffn_dim, 0.02)
        self.w3 = _Linear(config.dim, config.ffn_dim, out_std)
        self.w2 = _Linear(config.ffn_dim, config.dim, out_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm attention and feed-forward with residuals; the unit FSDP2 gathers one at a time."""

    def __init__(self, config: LlamaConfig, layer_id: int) -> None:
        super().__init__()
        out_std = 0.02 / math.sqrt(2 * (layer_id + 1))  # deeper blocks write smaller updates (torchtitan's depth init)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, out_std)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config, out_std)

    def forward(self, x: Tensor, rotation: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rotation)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama 3.1 decoder: token ids ``(batch, seq)`` to next-token logits ``(batch, seq, vocab_size)``.

    Example::

        model = Llama(LlamaConfig.from_name("llama3.1-micro"))
        logits = model(torch.randint(0, 257, (2, 16)))  # (2, 16, 257)

        with torch.device("meta"):  # shapes only, no memory: shard, then materialise
            big = Llama(LlamaConfig.from_name("llama3.1-8b"))
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)  # default init: N(0, 1)
        self.rope = RotaryEmbedding(config)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = _Linear(config.dim, config.vocab_size, config.dim**-0.5)

    def forward(self, tokens: Tensor) -> Tensor:
        seq_len = tokens.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"Llama {self.config.name!r}: a sequence of {seq_len} tokens exceeds the rotary context"
                f" max_seq_len={self.config.max_seq_len}."
            )
        rotation = self.rope(seq_len)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, rotation)
        return self.output(self.norm(x))
