"""FedAverager alone on 2 gloo ranks (one federation group each, one shard per group), launched by
test_averager.py under torchrun; each rank writes ``<out>/rank<r>.pt``.

Every round each group moves its fp32 shards by a small seeded step (:func:`local_step`, ~1e-4 of a weight, far
below bf16's 2^-8 spacing) and the averager syncs them. The same rounds run with ``sync_dtype`` bf16 and fp32, for
DiLoCo and for FedAvg; the test replays them in fp64. A checkpoint written the way earlier versions kept the
outer state (bf16, in ``sync_dtype``) is loaded into an averager that keeps it in fp32.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_fedshard.strategies.averager import FedAverager, like_param
from lightning_fedshard.strategies.group_checkpoint import load_group_state, save_group_state
from lightning_fedshard.strategies.ledger import CommLedger

ROUNDS = 6
STEP_SIZE = 1e-4  # of a weight's magnitude per round and group
SHAPES = {"a.weight": (6, 8), "b.bias": (5,)}
# name -> (outer optimizer, sync_dtype, alpha of the mixing)
RUNS = {
    "diloco_bf16": ("nesterov", torch.bfloat16, 0.0),
    "diloco_fp32": ("nesterov", torch.float32, 0.0),
    "diloco_fp64": ("nesterov", torch.float64, 0.0),  # a wire wider than the shards: the state takes its dtype
    "fedavg_bf16": ("avg", torch.bfloat16, 0.5),
    "fedavg_fp32": ("avg", torch.float32, 0.5),
}
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def initial_params() -> dict[str, torch.Tensor]:
    """fp32 weights of magnitude 0.5 to 2 with random signs, the same in both groups."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, shape in SHAPES.items():
        magnitude = 0.5 + 1.5 * torch.rand(shape, generator=gen)
        out[name] = torch.where(torch.rand(shape, generator=gen) < 0.5, -magnitude, magnitude)
    return out


def local_step(group: int, round_: int) -> dict[str, torch.Tensor]:
    """What group ``group`` adds to its shards before sync ``round_``: ~STEP_SIZE of each initial weight."""
    gen = torch.Generator().manual_seed(1000 * group + round_)
    return {
        name: STEP_SIZE * w.abs() * torch.randn(w.shape, generator=gen, dtype=torch.float32)
        for name, w in initial_params().items()
    }


def make_averager(mesh: DeviceMesh, outer: str, sync_dtype: torch.dtype) -> tuple[FedAverager, list[nn.Parameter]]:
    params = [
        nn.Parameter(DTensor.from_local(w.clone(), mesh["shard"], [Shard(0)], run_check=False))
        for w in initial_params().values()
    ]
    averager = FedAverager(
        zip(SHAPES, params),
        fed_group=mesh.get_group("fed"),
        replicate_group=mesh.get_group("replicate"),
        ledger=CommLedger(),  # counts the bytes on the wire
        outer_optimizer=outer,
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
        sync_dtype=sync_dtype,
    )
    return averager, params


@torch.no_grad()
def train(averager: FedAverager, params: list[nn.Parameter], group: int, rounds: range, alpha: float) -> None:
    for k in rounds:
        for p, step in zip(params, local_step(group, k).values(), strict=True):
            p.to_local().add_(step)
        averager.finish(averager.start(0), alpha)


def locals_of(params: list[nn.Parameter]) -> dict[str, torch.Tensor]:
    return {name: p.to_local().detach().clone() for name, p in zip(SHAPES, params, strict=True)}


def state_dtypes(averager: FedAverager) -> dict[str, list[str]]:
    return {part: [str(t.to_local().dtype) for t in ts.values()] for part, ts in averager.state_dict().items()}


def checkpoint_checks(mesh: DeviceMesh, group: int, out: Path) -> dict:
    """An outer state saved in bf16 (as kept before fp32 master state) loads, upcast exactly; an fp32 one round-trips
    bit for bit; and a run resumed from the fp32 checkpoint equals the uninterrupted one."""
    own = mesh.get_group("shard")  # the group's ranks (here one), which write its share of a checkpoint
    averager, params = make_averager(mesh, "nesterov", torch.bfloat16)
    train(averager, params, group, range(2), 0.0)
    saved = {part: {n: t.to_local().clone() for n, t in ts.items()} for part, ts in averager.state_dict().items()}
    # the layout earlier versions wrote: global copy and momentum as bf16 DTensors sharded like the parameters
    old = {
        part: {n: like_param(p, saved[part][n].to(torch.bfloat16)) for n, p in zip(SHAPES, params, strict=True)}
        for part in saved
    }
    save_group_state(out / "bf16_outer", group, {"outer": old}, own)
    save_group_state(out / "fp32_outer", group, {"outer": averager.state_dict()}, own)
    train(averager, params, group, range(2, 4), 0.0)
    uninterrupted = locals_of(params)

    results = {}
    for name, folder in (("from_bf16", "bf16_outer"), ("from_fp32", "fp32_outer")):
        fresh, fresh_params = make_averager(mesh, "nesterov", torch.bfloat16)
        state = {"outer": fresh.state_dict()}
        load_group_state(out / folder, group, state, own)
        fresh.load_state_dict(state["outer"])
        loaded = {part: {n: t.to_local().clone() for n, t in ts.items()} for part, ts in fresh.state_dict().items()}
        results[name] = {"loaded": loaded, "dtypes": state_dtypes(fresh)}
        if name == "from_fp32":  # resume: the shards as the sync left them, then the last two rounds
            with torch.no_grad():
                for p, ref in zip(fresh_params, loaded["reference"].values(), strict=True):
                    p.to_local().copy_(ref)
            train(fresh, fresh_params, group, range(2, 4), 0.0)
            results[name]["resumed"] = locals_of(fresh_params)
    results["saved"] = saved
    results["uninterrupted"] = uninterrupted
    return results


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    group = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=("fed", "replicate", "shard"))
    record: dict = {"group": group, "runs": {}}
    for name, (outer, sync_dtype, alpha) in RUNS.items():
        averager, params = make_averager(mesh, outer, sync_dtype)
        train(averager, params, group, range(ROUNDS), alpha)
        record["runs"][name] = {
            "final": locals_of(params),
            "state_dtypes": state_dtypes(averager),
            "fed_bytes": averager._ledger.close_step()["fed"],  # the rounds were not closed one by one
        }
    record["checkpoint"] = checkpoint_checks(mesh, group, out)
    torch.save(record, out / f"rank{group}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
