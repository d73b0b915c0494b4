"""Every codec through the real compressed collectives on gloo; launched by the tests under torchrun.

Usage: torchrun --nproc-per-node=4 collective_worker.py OUT_DIR [DEVICE [CODEC ...]] — each rank writes
``OUT_DIR/rank<r>.pt`` (tensors on the CPU). DEVICE ``cuda``: the inputs are CUDA tensors (every rank on GPU
``rank % device_count``), still over gloo; CODECs: only these (default all).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_fedshard._torch_compat import TorchDispatchMode
from lightning_fedshard.dynamiq import CODECS, CompressionStats, all_reduce, reduce_scatter

NUMEL = 70_001  # not a multiple of any block: exercises the padding
TOPOLOGIES = ("ring", "butterfly")


def rank_input(rank: int, numel: int = NUMEL) -> torch.Tensor:
    """Heavy-tailed, with scales that vary along the tensor like the layers of a model; shared by the test."""
    gen = torch.Generator().manual_seed(100 + rank)
    scale = torch.logspace(-2, 0, 8).repeat_interleave(-(-numel // 8))[:numel]
    return _student_t(gen, numel) * scale


class HostSyncCounter(TorchDispatchMode):
    """Counts the operations that make a GPU's host wait: reading a value (``.item()``, ``int()``, ``bool()``: all
    ``_local_scalar_dense``), ``nonzero`` (a size read from the data) and copies from a device to the host. On CPU
    tensors they cost nothing, but their number is the number the same call makes on CUDA."""

    WAITS = ("aten._local_scalar_dense", "aten.nonzero")

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        to_host = isinstance(out, torch.Tensor) and out.device.type == "cpu"
        from_device = any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)
        if name in self.WAITS or (name in ("aten._to_copy", "aten.copy_") and to_host and from_device):
            self.counts[name] += 1
        return out


def _student_t(gen: torch.Generator, numel: int) -> torch.Tensor:
    normal = torch.randn(numel, generator=gen)
    chi2 = torch.randn(3, numel, generator=gen).square().sum(dim=0)
    return normal / (chi2 / 3).sqrt()


def main(out: Path, device: str = "cpu", codecs: list[str] | None = None) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    x = rank_input(rank).to(device)
    record: dict = {"all_reduce": {}, "reduce_scatter": {}, "device": str(x.device)}
    for codec in sorted(codecs or CODECS):
        for topology in TOPOLOGIES:
            stats = CompressionStats()
            summed = all_reduce(x.clone(), codec=codec, bits=5.0, topology=topology, stats=stats, debug=True)
            gathered = [torch.empty_like(summed) for _ in range(world)]
            dist.all_gather(gathered, summed)
            record["all_reduce"][codec, topology] = {
                "result": summed.cpu(),
                "device": str(summed.device),
                "identical": all(torch.equal(gathered[0], g) for g in gathered),
                "bits": stats.bits_per_coord,
                "vnmse": stats.vnmse,
            }
        shard = torch.empty(NUMEL // world + 1, device=device)
        stats = CompressionStats()
        padded = torch.cat([x, x.new_zeros(world * shard.numel() - NUMEL)])
        reduce_scatter(shard, padded, codec=codec, bits=5.0, stats=stats)
        record["reduce_scatter"][codec] = {"result": shard.cpu(), "bits": stats.bits_per_coord}
    # whole blocks per rank: the view path (no copy into padded chunks) against the same values non-contiguous
    aligned = x[: world * 4096].clone()
    strided = aligned.new_empty(2 * aligned.numel())[::2].copy_(aligned)  # equal values, not contiguous
    record["aligned_reduce_scatter"] = {}
    for name, given in (("view", aligned), ("copy", strided)):
        stats = CompressionStats()
        out_shard = torch.empty(4096, device=device)
        reduce_scatter(out_shard, given, codec="dynamiq", bits=5.0, min_numel=0, stats=stats)
        record["aligned_reduce_scatter"][name] = {
            "result": out_shard.cpu(),
            "rechunked_calls": stats.rechunked_calls,
            "input_unchanged": torch.equal(given, x[: world * 4096]),
        }
    # the host waits of one call, whatever the world size: only the finite check's (the counter sees every rank's)
    record["host_syncs"] = {}
    for topology in TOPOLOGIES:
        with HostSyncCounter() as counter:
            all_reduce(x.clone(), codec="dynamiq", bits=5.0, topology=topology)
        record["host_syncs"]["all_reduce", topology] = dict(counter.counts)
    with HostSyncCounter() as counter:
        reduce_scatter(torch.empty(NUMEL // world + 1, device=device), padded, codec="dynamiq", bits=5.0)
    record["host_syncs"]["reduce_scatter", "ring"] = dict(counter.counts)
    small = x[:1000].clone()
    all_reduce(small, codec="dynamiq")
    exact = x[:1000].clone()
    dist.all_reduce(exact)
    record["small_fallback_equal"] = torch.equal(small, exact)
    torch.save(record, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cpu", sys.argv[3:] or None)
