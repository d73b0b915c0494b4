"""Sharded bound propagation on several gloo ranks, for tests/verify/test_sharding.py.

Usage: python -m tests.verify.shard_worker OUT_DIR WORLD WITH_BAB [PLAN ...] — spawns WORLD ranks; each runs every
case of :func:`cases` (root bounds, and the whole verifier if WITH_BAB is 1) under every plan of :data:`PLANS` (or
those named) and saves what it computed to ``OUT_DIR/rank<r>.pt``. The test computes the
single-process references itself (:func:`compute`, with ``plan=None``).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_fedshard.bench.verify_memory import random_mlp
from lightning_fedshard.verify import VerifyConfig, load_onnx, read_vnnlib, verify
from lightning_fedshard.verify.bounds.alpha import alpha_crown
from lightning_fedshard.verify.bounds.crown import intermediate_bounds, spec_lower
from lightning_fedshard.verify.budget import Budget
from lightning_fedshard.verify.config import Refine
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.memory import PeakMemoryMeter, tensor_bytes
from lightning_fedshard.verify.objective import OutputSpec, box_tensor
from lightning_fedshard.verify.ops import Mul, Sigmoid, Sin, Tanh
from lightning_fedshard.verify.shard.lockstep import lockstep
from lightning_fedshard.verify.shard.plan import ShardPlan
from lightning_fedshard.verify.spec import Property, local_robustness
from tests.verify.nets import GraphBuilder
from tests.verify.nets import resnet as small_resnet

MNIST = Path(__file__).resolve().parents[2].parent / "shared" / "vnncomp" / "mnist_fc_2022"
PLANS = {
    "fsdp": {"strategy": "fsdp"},
    "rows": {"strategy": "tp"},
    "zones": {"strategy": "tp", "tp_mode": "zones"},
    "fsdp+rows": {"strategy": "fsdp+rows"},
}
#: α-CROWN iterations for root bounds (short: equality is what is tested, not tightness).
ALPHA_ITERATIONS = 8
#: Zones are looser (their ReLUs are neither optimised nor split), so their searches get a short budget: what is
#: tested is that they never contradict the single-process verdict.
ZONES_TIMEOUT_S = 3.0


def resnet() -> tuple[BoundGraph, Property]:
    graph = small_resnet((3, 12, 12), width=4)
    center = torch.rand(graph.input.size, generator=torch.Generator().manual_seed(3)).double().numpy()
    label = int(graph(torch.as_tensor(center, dtype=torch.float32).view(1, -1)).argmax())
    return graph, local_robustness(center, 0.016, label, 10)  # unsat after branch-and-bound (32 domains)


def general() -> tuple[BoundGraph, Property]:
    """A graph of the operators beyond ReLU (48 inputs → sigmoid(fc) · tanh(fc) → fc → sine → 4 classes): too
    many inputs for input splitting, so its proof is neuron branch-and-bound over the sigmoid, tanh and sine inputs
    and the product's factors (GenBaB)."""
    b = GraphBuilder(0, (48,))
    b.linear("fc0", 24), b.add("squash", Sigmoid())
    b.linear("gate_in", 24, "x"), b.add("gate", Tanh())
    b.add("gated", Mul(((24,), (24,)), (24,)), "squash", "gate")
    b.linear("fc1", 16), b.add("wave", Sin()), b.linear("out", 4)
    graph = b.graph()
    center = torch.rand(48, generator=torch.Generator().manual_seed(3)).double().numpy()
    label = int(graph(torch.as_tensor(center, dtype=torch.float32).view(1, -1)).argmax())
    return graph, local_robustness(center, 0.074, label, 4)  # α-CROWN leaves it open; unsat after branching


def mnist(net: str, prop: str) -> tuple[BoundGraph, Property]:
    graph = load_onnx(MNIST / "onnx" / f"mnist-net_{net}.onnx")
    return graph, read_vnnlib(MNIST / "vnnlib" / f"prop_{prop}.vnnlib", graph.input.size, graph.output.size)


def wide_mlp() -> tuple[BoundGraph, Property]:
    """A random 784 → 1024 ×3 → 10 ReLU MLP whose weights are a fair part of the memory, for the memory checks."""
    graph = random_mlp((1024,) * 3, seed=5)
    center = torch.rand(784, generator=torch.Generator().manual_seed(5)).double().numpy()
    label = int(graph(torch.as_tensor(center, dtype=torch.float32).view(1, -1)).argmax())
    return graph, local_robustness(center, 0.002, label, 10)


def cases() -> dict[str, tuple[BoundGraph, Property, bool]]:
    """name → (graph, property, whether to run the full verifier with branch-and-bound as well)."""
    return {
        "256x2_bab": (*mnist("256x2", "6_0.03"), True),  # unsat after branch-and-bound
        "256x2_sat": (*mnist("256x2", "0_0.05"), True),
        "256x4": (*mnist("256x4", "1_0.03"), False),
        "resnet": (*resnet(), True),
        "general": (*general(), True),
    }


def root_bounds(graph: BoundGraph, prop: Property, plan: ShardPlan | None) -> dict[str, object]:
    """IBP, CROWN and α-CROWN bounds of the property's first case, and the pre-activation bounds."""
    case = prop.cases[0]
    box = box_tensor(case.box.lower, case.box.upper, graph.input.shape, graph.dtype)
    spec = OutputSpec.from_case(case, graph.output.shape, graph.dtype)
    partition = plan.partition if plan is not None else None
    with torch.no_grad(), lockstep(plan.lockstep_group if plan is not None else None):
        ibp = graph.ibp(box)[graph.output.name]
        bounds = intermediate_bounds(graph, box, partition=partition)
        crown = spec_lower(graph, spec.rows(1), box, bounds, partition=partition)
    with lockstep(plan.lockstep_group if plan is not None else None):
        alpha = alpha_crown(graph, box, spec.rows(1), ALPHA_ITERATIONS, partition=partition)
    pres = set(graph.bounded)
    return {
        "box": box,
        "ibp": (ibp.lower, ibp.upper),
        "crown": crown,
        "pre": {name: (b.lower, b.upper) for name, b in bounds.items() if name in pres},
        "alpha": alpha.lower,
        "alpha_slopes": alpha.alphas,
    }


def verdict(graph: BoundGraph, prop: Property, plan: ShardPlan | None) -> dict[str, object]:
    timeout = ZONES_TIMEOUT_S if plan is not None and plan.tp_mode.value == "zones" and plan.sharded else 60.0
    # LP/MILP refinement runs only unsharded: the single-process reference must search like the sharded runs
    config = VerifyConfig(timeout=timeout, alpha_iterations=ALPHA_ITERATIONS, refine=Refine.NONE)
    result = verify(graph, prop, config, plan)
    cex = result.counterexample
    return {
        "verdict": result.verdict.value,
        "margins": result.root_margins,
        "domains": result.domains_bounded,
        "cex": None if cex is None else cex.x,
    }


def crown_memory(graph: BoundGraph, prop: Property, plan: ShardPlan | None) -> dict[str, int]:
    """Resident bytes and peak live bytes of one CROWN bound of the property, and the weight all-gathers it
    issued (sharded weights)."""
    case = prop.cases[0]
    box = box_tensor(case.box.lower, case.box.upper, graph.input.shape, graph.dtype)
    spec = OutputSpec.from_case(case, graph.output.shape, graph.dtype)
    partition = plan.partition if plan is not None else None
    gatherer = next((n.op._fsdp_gatherer for n in graph.nodes[1:] if hasattr(n.op, "_fsdp_gatherer")), None)
    gathers = []
    if gatherer is not None:
        launch = gatherer._launch
        gatherer._launch = lambda op, async_op: gathers.append(op) or launch(op, async_op)
    meter = PeakMemoryMeter(resident_bytes=tensor_bytes(graph.constants()))
    with torch.no_grad(), lockstep(plan.lockstep_group if plan is not None else None), meter:
        bounds = intermediate_bounds(graph, box, partition=partition)
        spec_lower(graph, spec.rows(1), box, bounds, partition=partition)
    return {"baseline": meter.baseline_bytes, "peak": meter.peak_bytes, "gathers": len(gathers)}


def chunked_bounds(graph: BoundGraph, prop: Property, plan: ShardPlan | None) -> dict[str, object]:
    """The pre-activation bounds and the spec bound of the property under a 24 MiB memory budget (the passes need
    several times that, so they run in chunks), and which passes were cut."""
    case = prop.cases[0]
    box = box_tensor(case.box.lower, case.box.upper, graph.input.shape, graph.dtype)
    spec = OutputSpec.from_case(case, graph.output.shape, graph.dtype)
    partition = plan.partition if plan is not None else None
    budget = Budget.start(timeout=600, memory_gib=24 / 1024)
    with torch.no_grad(), lockstep(plan.lockstep_group if plan is not None else None), budget.using():
        bounds = intermediate_bounds(graph, box, partition=partition)
        crown = spec_lower(graph, spec.rows(1), box, bounds, partition=partition)
    pres = set(graph.bounded)
    return {
        "pre": {n: (b.lower, b.upper) for n, b in bounds.items() if n in pres},
        "crown": crown,
        "cut": budget._tight,
    }


def compute(plan: ShardPlan | None, with_bab: bool = True) -> dict[str, dict]:
    """Everything the tests compare."""
    out: dict[str, dict] = {}
    for name, (graph, prop, run_verifier) in cases().items():
        sharded = plan.shard(graph) if plan is not None else graph
        out[name] = root_bounds(sharded, prop, plan)
        if with_bab and run_verifier:
            out[name]["verify"] = verdict(sharded, prop, plan)
    graph, prop = wide_mlp()
    sharded = plan.shard(graph) if plan is not None else graph
    out["wide"] = crown_memory(sharded, prop, plan)
    out["wide_chunked"] = chunked_bounds(sharded, prop, plan)
    return out


def _rank(rank: int, world: int, port: int, out_dir: str, with_bab: bool, plans: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {key: compute(ShardPlan(group=dist.group.WORLD, **PLANS[key]), with_bab) for key in plans}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    out_dir, world, with_bab, plans = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4:] or list(PLANS)
    # fork: the ranks inherit this interpreter's imports (~10 s of CPU each under spawn, most of a launch on 2
    # cores); nothing has run a kernel or started a thread pool yet, and the ranks use the CPU and gloo only
    mp.start_processes(_rank, args=(world, _free_port(), out_dir, with_bab, plans), nprocs=world, start_method="fork")
