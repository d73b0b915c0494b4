"""Counts the bytes each rank sends on each tier of the FL mesh, from the tensors actually communicated.

Bytes follow the ring algorithms NCCL and gloo use for large messages, per rank and per call:
all-gather sends ``out·(n-1)/n``, reduce-scatter ``in·(n-1)/n``, all-reduce ``2·t·(n-1)/n`` and a
(pipelined) broadcast ``t·(n-1)/n`` on average, where ``n`` is the group size and sizes are in bytes.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from lightning_fedshard.compat import AllGather, ReduceScatter

__all__ = ["TIERS", "CommLedger", "install_fsdp_counters", "ring_bytes"]

#: Tiers, innermost first: FSDP all-gather/reduce-scatter, HSDP gradient all-reduce, FedAvg across groups.
TIERS = ("shard", "replicate", "fed")


# torch 2.13 renamed the tensor-in/tensor-out collectives and deprecated the old names. Looked up at each call, so
# that a wrapper of torch.distributed's functions (bench/step_profile.py) sees FSDP's collectives too.
def _all_gather_single(*args, **kwargs):
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args, **kwargs):
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(*args, **kwargs)


_RING_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2, "broadcast": 1}


def ring_bytes(collective: str, nbytes: int, group_size: int) -> float:
    """Bytes one rank sends for ``collective`` on a tensor of ``nbytes`` (the larger side) over ``group_size`` ranks."""
    return _RING_FACTOR[collective] * nbytes * (group_size - 1) / group_size


class CommLedger:
    """Per-rank byte counts by tier, for the current optimizer step and in total.

    Example::

        ledger = CommLedger()
        ledger.record("fed", "all_reduce", tensor.numel() * tensor.element_size(), group_size=2)
        per_step = ledger.close_step()  # {"shard": 0.0, "replicate": 0.0, "fed": ...}
    """

    def __init__(self) -> None:
        self._step: dict[str, float] = defaultdict(float)
        self._fragment_step: dict[int, float] = defaultdict(float)
        self.totals: dict[str, float] = dict.fromkeys(TIERS, 0.0)
        self.fragment_totals: dict[int, float] = defaultdict(float)
        """Fed bytes per model fragment (streaming sync; blocking sync averages one fragment, 0), in total."""
        self.last_fragment_step: dict[int, float] = {}
        """Fed bytes per fragment of the step :meth:`close_step` closed last."""
        self.steps = 0
        self.paused = False

    def record(self, tier: str, collective: str, nbytes: int, group_size: int, fragment: int | None = None) -> None:
        """Counts one call's ring bytes; ``fragment`` names the model fragment a fed call averages."""
        self.record_sent(tier, ring_bytes(collective, nbytes, group_size), fragment)

    def record_sent(self, tier: str, nbytes: float, fragment: int | None = None) -> None:
        """Adds bytes this rank actually sent, for collectives that count their own (compressed) traffic."""
        if tier not in TIERS:
            raise ValueError(f"Unknown communication tier {tier!r}; expected one of {TIERS}.")
        if self.paused:
            return
        self._step[tier] += nbytes
        if fragment is not None:
            self._fragment_step[fragment] += nbytes

    def close_step(self) -> dict[str, float]:
        """Ends the current optimizer step and returns its bytes per tier."""
        step = {tier: self._step.get(tier, 0.0) for tier in TIERS}
        for tier, value in step.items():
            self.totals[tier] += value
        for fragment, value in self._fragment_step.items():
            self.fragment_totals[fragment] += value
        self.last_fragment_step = dict(self._fragment_step)
        self._step.clear()
        self._fragment_step.clear()
        self.steps += 1
        return step

    def mean_per_step(self) -> dict[str, float]:
        return {tier: total / max(self.steps, 1) for tier, total in self.totals.items()}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _CountingAllGather(AllGather):
    def __init__(self, ledger: CommLedger) -> None:
        self._ledger = ledger

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self._ledger.record("shard", "all_gather", _nbytes(output_tensor), dist.get_world_size(group))
        return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _CountingReduceScatter(ReduceScatter):
    def __init__(self, ledger: CommLedger) -> None:
        self._ledger = ledger

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self._ledger.record("shard", "reduce_scatter", _nbytes(input_tensor), dist.get_world_size(group))
        return _reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def install_fsdp_counters(module: torch.nn.Module, ledger: CommLedger, replicate_size: int) -> None:
    """Routes every FSDP2 unit's all-gather and reduce-scatter through ``ledger`` and, for HSDP, counts the
    replicate all-reduce of gradients (FSDP2 calls the all-reduce hook with that all-reduce's output)."""
    all_gather, reduce_scatter = _CountingAllGather(ledger), _CountingReduceScatter(ledger)

    def count_replicate_all_reduce(reduce_output: torch.Tensor) -> None:
        ledger.record("replicate", "all_reduce", _nbytes(reduce_output), replicate_size)

    for fsdp_module in module.modules():
        if isinstance(fsdp_module, FSDPModule):
            fsdp_module.set_custom_all_gather(all_gather)
            fsdp_module.set_custom_reduce_scatter(reduce_scatter)
            if replicate_size > 1:
                fsdp_module.set_all_reduce_hook(count_replicate_all_reduce)
