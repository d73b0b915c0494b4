"""AdamW whose two moments are stored in 8 bits with one scale per block (about a quarter of AdamW's state)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer

from lightning_fedshard.optim.block_quant import (
    dequantize_signed,
    dequantize_sqrt,
    num_blocks,
    quantize_signed,
    quantize_sqrt,
)
from lightning_fedshard.optim.owner_exchange import ShardLayout, local_shard

__all__ = ["AdamW8bit", "adam_ratio_bound"]

BLOCK_SIZES = (32, 64, 128, 256)
MOMENT_CODES = "log-stochastic-v1"  # block_quant's format; checkpoints with another (or none: linear codes) are refused


def adam_ratio_bound(beta1: float, beta2: float, step: int) -> float:
    """The largest ``|m̂_t| / √v̂_t`` that Adam's exact moments reach after ``step`` gradients (any gradients).

    With ``ρ = β1²/β2``, Cauchy–Schwarz on ``m_t = (1-β1) Σ β1^(t-i) g_i`` against ``v_t = (1-β2) Σ β2^(t-i) g_i²``
    gives ``|m_t| ≤ (1-β1) √(Σ_{k<t} ρ^k / (1-β2)) · √v_t``, with equality for ``g_i ∝ (β1/β2)^(t-i)``; the bias
    corrections turn it into ``(1-β1)/(1-β1^t) · √((1-β2^t) Σ_{k<t} ρ^k / (1-β2))`` (1 at the first step). With
    ``β2 = 0`` the ratio is unbounded (``inf``), and with ``β1² > β2`` it grows geometrically (``inf`` past a float)."""
    if beta2 == 0.0:
        return math.inf
    rho = beta1 * beta1 / beta2
    try:
        series = float(step) if rho == 1.0 else (1.0 - rho**step) / (1.0 - rho)
    except OverflowError:
        return math.inf
    return (1.0 - beta1) / (1.0 - beta1**step) * math.sqrt((1.0 - beta2**step) * series / (1.0 - beta2))


class AdamW8bit(Optimizer):
    """AdamW (decoupled weight decay, bias-corrected) with int8 first and uint8 second moments.

    Each parameter's moments are coded per block of ``block_size`` consecutive coordinates of the rank's local shard
    (:mod:`~lightning_fedshard.optim.block_quant`: log-spaced levels, signed for ``m``, of the square root for ``v``,
    stochastically rounded so the moments are unbiased), so a block never crosses a shard boundary; with
    block-aligned shards (:class:`~lightning_fedshard.optim.BlockShardPlan`) the blocks are the whole tensor's, and a
    sharded run is bit for bit the single-process one. A step decodes both moments to fp32, updates them with the
    gradient, steps the parameter with the fp32 values and codes them again.

    The denominator is ``max(√v̂, |m̂| / B_t) + eps``, where ``B_t`` is the largest ``|m̂| / √v̂`` exact moments can
    reach at step ``t`` (:func:`adam_ratio_bound`, Cauchy–Schwarz): it never binds on exact moments, and it keeps a
    coordinate whose coded ``√v`` fell to 0 while ``m`` survived from stepping by ``lr · |m̂| / eps``.

    Parameters with fewer than ``min_8bit_numel`` elements (norms, biases; 4,096 as bitsandbytes' ``min_8bit_size``)
    keep fp32 moments and take exactly ``torch.optim.AdamW``'s step: their scales would cost as much as they save.
    State per parameter: ``step``; ``exp_avg``/``exp_avg_sq`` (the codes, or fp32) shaped and sharded like the
    parameter; ``exp_avg_scale``/``exp_avg_sq_scale`` (fp32, one per block, each rank's blocks a ``Shard(0)`` slice
    padded to the largest rank's count) — DTensors under FSDP2, so DCP saves and restores them per shard like AdamW's.
    Each param group records ``moment_codes`` (the code format), so a checkpoint of another format is refused.

    Example::

        optimizer = AdamW8bit(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, block_size=128)
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        block_size: int = 128,
        min_8bit_numel: int = 4096,
    ) -> None:
        if not 0.0 <= lr < math.inf:
            raise ValueError(f"AdamW8bit: `lr` must be finite and ≥ 0, got {lr}.")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW8bit: `betas` must be in [0, 1), got {betas}.")
        if block_size not in BLOCK_SIZES:
            raise ValueError(f"AdamW8bit: `block_size` must be one of {BLOCK_SIZES}, got {block_size!r}.")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "moment_codes": MOMENT_CODES,
        }
        super().__init__(params, defaults)
        self.block_size = block_size
        self.min_8bit_numel = min_8bit_numel

    def quantized(self, p: Tensor) -> bool:
        """Whether ``p``'s moments are stored in 8 bits (decided on the global size, the same on every rank)."""
        return p.numel() >= self.min_8bit_numel

    def _init_state(self, p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        if self.quantized(p):
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.int8)
            state["exp_avg_scale"] = self._scales_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.uint8)
            state["exp_avg_sq_scale"] = self._scales_like(p)
        else:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        return state

    def _scales_like(self, p: Tensor) -> Tensor:
        if not isinstance(p, DTensor):
            return torch.zeros(num_blocks(p.numel(), self.block_size), device=p.device)
        layout = ShardLayout.of(p)
        per_rank = num_blocks(layout.local_numel(0), self.block_size)  # rank 0's shard is the largest
        placements = [Shard(0) if pl.is_shard() else Replicate() for pl in p.placements]
        local = torch.zeros(per_rank, device=p.to_local().device)
        return DTensor.from_local(
            local, p.device_mesh, placements, run_check=False, shape=(per_rank * layout.world,), stride=(1,)
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :class:`torch.optim.Optimizer`'s, but every state tensor keeps its saved dtype and is only moved to its
        parameter's device: torch's would cast the int8/uint8 codes (and the fp32 scales and moments) to the
        parameter's dtype, materialising an fp32 copy of every code (4x the optimizer's memory on resume) and turning
        scales into bf16 for a bf16 model. A tensor already on the device is taken as it is (no copy), as torch does
        with state of the parameter's dtype. A checkpoint of another code format is refused."""
        codes = {group.get("moment_codes") for group in state_dict["param_groups"]}
        if codes != {MOMENT_CODES} and any("exp_avg_scale" in s for s in state_dict["state"].values()):
            raise ValueError(
                f"AdamW8bit: the checkpoint's 8-bit moments use the code format {codes - {MOMENT_CODES}} (None: the "
                f"linear codes before issue 32), this version reads {MOMENT_CODES!r}; decoding them would give wrong "
                "moments. Resume with the version that wrote it, or start the optimizer state afresh."
            )
        tensors = {
            pid: {k: v for k, v in s.items() if k != "step" and isinstance(v, Tensor)}
            for pid, s in state_dict["state"].items()
        }
        rest = {pid: {k: v for k, v in s.items() if k not in tensors[pid]} for pid, s in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": rest})
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params):
            for key, value in tensors.get(pid, {}).items():
                self.state[p][key] = value.to(device=p.device)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p] if self.state[p] else self._init_state(p)
                state["step"] += 1
                tensors = [local_shard(p), local_shard(p.grad), local_shard(state["exp_avg"])]
                tensors.append(local_shard(state["exp_avg_sq"]))
                if "exp_avg_scale" not in state:
                    self._update(*tensors, None, None, group, int(state["step"]))
                    continue
                scales = local_shard(state["exp_avg_scale"]), local_shard(state["exp_avg_sq_scale"])
                for piece, blocks in _pieces(tensors, self.block_size):
                    self._update(*piece, *(s[blocks] for s in scales), group, int(state["step"]))
        return loss

    def _update(
        self,
        param: Tensor,
        grad: Tensor,
        m_store: Tensor,
        v_store: Tensor,
        m_scales: Tensor | None,
        v_scales: Tensor | None,
        group: dict[str, Any],
        t: int,
    ) -> None:
        """One AdamW step of (a piece of) a local shard: the coded moments (with their blocks' scales) are decoded,
        updated and coded again; fp32 moments (``m_scales`` None) are updated in place."""
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        block, quantized = self.block_size, m_scales is not None
        grad = grad.float()
        if quantized:
            m = dequantize_signed(m_store, m_scales, block)
            v = dequantize_sqrt(v_store, v_scales, block)
        else:
            m, v = m_store, v_store
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        correction1, correction2 = 1 - beta1**t, 1 - beta2**t
        denom = v.sqrt() / correction2**0.5  # as torch.optim.AdamW, to the bit
        if quantized:
            denom = denom.maximum(m.abs() / (correction1 * adam_ratio_bound(beta1, beta2, t)))
        denom.add_(eps)
        param.mul_(1 - lr * decay)
        param.addcdiv_(m.to(param.dtype), denom.to(param.dtype), value=-lr / correction1)
        if quantized:
            codes, scales = quantize_signed(m, block, seed=2 * t)
            m_store.copy_(codes)
            m_scales[: scales.numel()].copy_(scales)
            codes, scales = quantize_sqrt(v, block, seed=2 * t + 1)
            v_store.copy_(codes)
            v_scales[: scales.numel()].copy_(scales)


#: Coordinates of a large parameter stepped at a time (a multiple of every block size): a step's fp32 temporaries
#: (about 11 of the piece's size) stay near 700 MiB instead of 11 times the largest parameter, 23 GB for Llama 3.1
#: 8B's embedding. The pieces are whole blocks, and a block's rounding depends on its scale, the seed and the
#: position in the block only, so the pieces give the whole tensor's step to the bit.
PIECE_NUMEL = 1 << 24


def _pieces(tensors: list[Tensor], block: int) -> Iterator[tuple[list[Tensor], slice]]:
    """Flat views of ``tensors`` (a local shard, its gradient and codes, all shaped alike) over consecutive runs of
    :data:`PIECE_NUMEL` coordinates, each with the slice of the blocks it covers; one whole piece when a tensor is
    not contiguous (no flat view)."""
    numel = tensors[0].numel()
    if not all(t.is_contiguous() for t in tensors) or numel <= PIECE_NUMEL:
        yield tensors, slice(None)
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, numel, PIECE_NUMEL):
        stop = min(start + PIECE_NUMEL, numel)
        yield [f[start:stop] for f in flat], slice(start // block, num_blocks(stop, block))
