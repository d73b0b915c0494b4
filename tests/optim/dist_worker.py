"""Muon and AdamW8bit on real FSDP2 shards (4 gloo ranks) against single-process references.

Launched by test_distributed.py under torchrun; rank 0 writes ``<out>/results.json`` with what every check found.
Gradients are set from seeded whole tensors (the same bits on every rank, sharded like the parameters), so the
checks compare the optimizers' arithmetic, not FSDP2's reduce-scatter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_fedshard.optim import AdamW8bit, Muon, muon_param_groups

STEPS = 3


class Net(nn.Module):
    """Matrices that shard evenly, unevenly (10 rows on 4 ranks: 3, 3, 3, 1), on dim 1, plus an embedding,
    biases and a norm for the AdamW side."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 16)
        self.a = nn.Linear(16, 32)  # weight 32×16
        self.b = nn.Linear(32, 10, bias=False)  # 10×32: uneven rows
        self.c = nn.Linear(10, 8, bias=False)  # 8×10: no even dim 1, sharded on dim 0
        self.wide = nn.Linear(64, 8, bias=False)  # 8×64: sharded on dim 1 (Shard(1))
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 12, bias=False)


def build(mesh=None) -> Net:
    torch.manual_seed(0)
    net = Net()
    if mesh is not None:
        def placement(p: nn.Parameter) -> Shard:
            return Shard(1) if tuple(p.shape) == (8, 64) else Shard(0)

        for child in net.children():
            fully_shard(child, mesh=mesh, shard_placement_fn=placement)
    return net


def set_grads(net: Net, step: int, salt: int = 0) -> None:
    gen = torch.Generator().manual_seed(1000 * salt + step)
    for p in net.parameters():
        whole = torch.randn(p.shape, generator=gen)
        p.grad = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else whole


def whole(net: Net) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in net.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def muon(net: Net) -> Muon:
    return Muon(muon_param_groups(net), lr=0.02, weight_decay=0.1, adamw_lr=0.01)


def adamw8bit(net: Net) -> AdamW8bit:
    return AdamW8bit(net.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, block_size=32, min_8bit_numel=0)


def run_muon(mesh, salt: int, results: dict, key: str) -> None:
    """Muon on the shards of ``mesh`` against one process stepping the whole matrices with the same gradients."""
    net, ref = build(mesh), build()
    opt, ref_opt = muon(net), muon(ref)
    diffs, owned = [], []
    for step in range(STEPS):
        set_grads(net, step, salt)
        set_grads(ref, step, salt)
        opt.step()
        ref_opt.step()
        diffs.append(max_diff(whole(net), whole(ref)))
        owned.append(opt.orthogonalised)
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, owned)
    results[key] = {
        "placements": {n: str(p.placements) for n, p in net.named_parameters()},
        "local_rows": {n: p.to_local().shape[0] for n, p in net.named_parameters()},
        "max_diff_per_step": diffs,
        "owned_per_rank": per_rank,  # [rank][step] -> matrix indices
        "matrices": sum(len(g["params"]) for g in opt.param_groups if g["use_muon"]),
        "ref_orthogonalised": ref_opt.orthogonalised,
    }


def per_shard_reference(mesh) -> tuple[dict, dict]:
    """AdamW8bit in one process, each parameter split into the ranks' shards (the same blocks as the sharded run)."""
    ref = build()
    world = mesh.size()
    pieces = {}
    shard_dims = {n: (1 if tuple(p.shape) == (8, 64) else 0) for n, p in ref.named_parameters()}
    for n, p in ref.named_parameters():
        pieces[n] = [nn.Parameter(t.clone()) for t in torch.chunk(p.detach(), world, dim=shard_dims[n])]
    opt = AdamW8bit(
        [t for ts in pieces.values() for t in ts], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, block_size=32,
        min_8bit_numel=0,
    )
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        for n, p in ref.named_parameters():
            for t, g in zip(pieces[n], torch.chunk(torch.randn(p.shape, generator=gen), world, dim=shard_dims[n])):
                t.grad = g.clone()
        opt.step()
    params = {n: torch.cat([t.detach() for t in ts], dim=shard_dims[n]) for n, ts in pieces.items()}
    codes = {n: torch.cat([opt.state[t]["exp_avg"] for t in ts], dim=shard_dims[n]) for n, ts in pieces.items()}
    return params, codes


def run_adamw8bit(mesh, results: dict) -> None:
    net = build(mesh)
    opt = adamw8bit(net)
    whole_ref = build()
    whole_opt = adamw8bit(whole_ref)
    for step in range(STEPS):
        set_grads(net, step)
        set_grads(whole_ref, step)
        opt.step()
        whole_opt.step()
    got = whole(net)
    shard_params, shard_codes = per_shard_reference(mesh)
    codes = {n: opt.state[p]["exp_avg"].full_tensor() for n, p in net.named_parameters()}
    whole_state = {n: whole_opt.state[p]["exp_avg"] for n, p in whole_ref.named_parameters()}
    results["adamw8bit"] = {
        "bit_identical_to_per_shard_reference": {n: torch.equal(got[n], shard_params[n]) for n in got},
        "codes_identical_to_per_shard_reference": {n: torch.equal(codes[n], shard_codes[n]) for n in got},
        # a.weight 32×16 on 4 ranks: shards of 128 = 4 blocks of 32, so the whole-tensor run has the same blocks
        "aligned_weight_identical_to_whole_run": torch.equal(got["a.weight"], whole(whole_ref)["a.weight"])
        and torch.equal(codes["a.weight"], whole_state["a.weight"]),
        "local_code_dtypes": sorted({str(opt.state[p]["exp_avg"].to_local().dtype) for p in net.parameters()}
                                   | {str(opt.state[p]["exp_avg_sq"].to_local().dtype) for p in net.parameters()}),
    }


def run_resume(mesh, make_opt, key: str, ckpt: Path, results: dict) -> None:
    """Two steps, a DCP checkpoint, two more; then a fresh model and optimizer load it and take the last two."""
    net = build(mesh)
    opt = make_opt(net)
    for step in range(4):
        if step == 2:
            dcp.save({"model": net.state_dict(), "optim": get_optimizer_state_dict(net, opt)}, checkpoint_id=ckpt)
        set_grads(net, step)
        opt.step()
    uninterrupted = whole(net)
    fresh = build(mesh)
    fresh_opt = make_opt(fresh)
    state = {"model": fresh.state_dict(), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(state, checkpoint_id=ckpt)
    fresh.load_state_dict(state["model"])
    set_optimizer_state_dict(fresh, fresh_opt, optim_state_dict=state["optim"])
    for step in (2, 3):
        set_grads(fresh, step)
        fresh_opt.step()
    resumed = whole(fresh)
    results[key] = {n: torch.equal(resumed[n], uninterrupted[n]) for n in resumed}
    results[f"{key}_state_dtypes"] = [_state_dtypes(opt), _state_dtypes(fresh_opt)]


def _state_dtypes(opt) -> list[str]:
    return sorted({f"{k}:{v.dtype}" for state in opt.state.values() for k, v in state.items() if k != "step"})


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict = {"world": world}
    fsdp = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    run_muon(fsdp, 0, results, "muon_fsdp2")
    # fl_fsdp's layout: 2 federation groups × 2 shards; each group steps on its own gradients
    fl = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("fed", "shard"))
    group = fl.get_local_rank("fed")
    run_muon(fl["shard"], 1 + group, results, f"muon_fl_fsdp_group{group}")
    run_adamw8bit(fsdp, results)
    run_resume(fsdp, adamw8bit, "resume_adamw8bit", out / "ckpt_adamw8bit", results)
    run_resume(fsdp, muon, "resume_muon", out / "ckpt_muon", results)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        (out / "results.json").write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
