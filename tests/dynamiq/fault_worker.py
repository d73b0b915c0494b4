"""Bad and unusual tensors through the real compressed collectives on gloo; launched by the tests under torchrun.

Usage: torchrun --nproc-per-node=2 fault_worker.py OUT_DIR — each rank writes ``OUT_DIR/rank<r>.pt``: for every
case, the error it raised (``None`` if none) and what it computed. A rank that raised alone would leave the other
waiting for its messages until the group's (short) timeout, and record that timeout instead of the same error.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_fedshard.dynamiq import all_reduce, reduce_scatter

NUMEL = 1 << 17  # above the default min_numel: these go through the compressed ring
#: Short enough that a rank left waiting records the timeout well inside the test's patience.
GROUP_TIMEOUT = timedelta(seconds=20)


def rank_input(rank: int, numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(10 + rank))


def counts(rank: int) -> torch.Tensor:
    """int64 values far beyond fp32's 24-bit mantissa, shared by the test."""
    return torch.randint(-(2**40), 2**40, (NUMEL,), generator=torch.Generator().manual_seed(20 + rank))


def complex_input(rank: int) -> torch.Tensor:
    return torch.randn(NUMEL // 2, dtype=torch.complex64, generator=torch.Generator().manual_seed(30 + rank))


def attempt(compute) -> dict:
    try:
        return {"error": None, "result": compute()}
    except Exception as error:  # noqa: BLE001 -- any error is the record: the test compares them across ranks
        return {"error": f"{type(error).__name__}: {error}", "result": None}


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = rank_input(rank)
    poisoned = x.clone()
    if rank == 1:
        poisoned[NUMEL // 3] = float("nan")
    infinite = x.clone()
    if rank == 0:
        infinite[7] = float("inf")
    shard = torch.empty(NUMEL // world)
    record = {
        "nan_ring": attempt(lambda: all_reduce(poisoned.clone(), codec="dynamiq")),
        "nan_butterfly": attempt(lambda: all_reduce(poisoned.clone(), codec="dynamiq", topology="butterfly")),
        "inf_reduce_scatter": attempt(lambda: reduce_scatter(shard, infinite, codec="dynamiq")),
        "nan_thc": attempt(lambda: all_reduce(poisoned.clone(), codec="thc", bits=4)),
        # after the errors every rank is still in step: a good collective right after gives identical results
        "after": attempt(lambda: all_reduce(x.clone(), codec="dynamiq")),
        "int64": attempt(lambda: all_reduce(counts(rank), codec="dynamiq")),
        "bool": attempt(lambda: all_reduce(x > 1.5, codec="dynamiq", min_numel=0)),
        "complex": attempt(lambda: all_reduce(complex_input(rank), codec="dynamiq")),
        "empty": attempt(lambda: all_reduce(torch.empty(0), codec="dynamiq", min_numel=0)),
        "empty_reduce_scatter": attempt(
            lambda: reduce_scatter(torch.empty(0), torch.empty(0), codec="dynamiq", min_numel=0)
        ),
    }
    alone = dist.new_group([0]), dist.new_group([1])  # every rank creates every group, in the same order
    record["world_of_one"] = attempt(lambda: all_reduce(x.clone(), codec="dynamiq", group=alone[rank], min_numel=0))
    if record["after"]["result"] is not None:
        gathered = [torch.empty(NUMEL) for _ in range(world)]
        dist.all_gather(gathered, record["after"]["result"])
        record["after"]["identical"] = torch.equal(gathered[0], gathered[1])
    torch.save(record, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
