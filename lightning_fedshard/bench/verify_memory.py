"""Memory per rank of sharded bound propagation: single process against FSDP, tensor-parallel rows (with
domain-sharded branch-and-bound), Megatron zones and FSDP with rows (both at once), on real gloo ranks.

    python -m lightning_fedshard.bench verify-memory [--out runs/verify-memory] [--quick]

(``fedshard bench verify-memory ...`` is the same.) For every network (wide random ReLU MLPs on 784 inputs and
the VNN-COMP 2022 mnist_fc nets) and every strategy, each rank measures with
:class:`~lightning_fedshard.verify.memory.PeakMemoryMeter` (live tensor storage, plus the constants it holds):

* ``baseline``: what the rank holds before propagating (weights, or its shards);
* ``crown``: the peak of CROWN (intermediate and output bounds, no autograd) on a robustness property;
* ``alpha``: the peak of α-CROWN (``ALPHA_ITERATIONS`` iterations) on it;
* ``bab``: the peak of one β-CROWN batch of ``BAB_DOMAINS`` branch-and-bound domains (``BETA_ITERATIONS``
  iterations), with the output pass's α tensors: whole on every rank for single/FSDP/zones, dealt out (``1/P``
  of the domains per rank) for the row-parallel strategies, which is what their search does (``fsdp+rows`` holds
  its weights whole for it: its ranks search alone);

and the time of each phase. The table gives the largest rank's numbers and their ratio to single in the same
run; ``OUT/results.json`` holds every rank, ``OUT/memory_vs_ranks.png`` plots memory against P.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_fedshard.verify import (
    BoundGraph,
    CasePhases,
    Node,
    PeakMemoryMeter,
    Property,
    ShardPlan,
    load_onnx,
    local_robustness,
)
from lightning_fedshard.verify.ops import Linear, ReLU

__all__ = ["MemoryRow", "main", "random_mlp"]

MNIST = Path(__file__).resolve().parents[2].parent / "shared" / "vnncomp" / "mnist_fc_2022" / "onnx"
WIDE_MLPS = {"mlp-1024x4": (1024,) * 4, "mlp-2048x4": (2048,) * 4, "mlp-4096x2": (4096,) * 2}
QUICK_MLPS = {"mlp-512x3": (512,) * 3}
ALPHA_ITERATIONS = 5
BAB_DOMAINS = 64
BETA_ITERATIONS = 5
EPS = 0.01
#: (name, plan keyword arguments, ranks); single first: the ratios are to it.
STRATEGIES = (
    ("single", {}, 1),
    ("fsdp", {"strategy": "fsdp"}, 2),
    ("fsdp", {"strategy": "fsdp"}, 4),
    ("tp-rows", {"strategy": "tp"}, 2),
    ("tp-rows", {"strategy": "tp"}, 4),
    ("tp-zones", {"strategy": "tp", "tp_mode": "zones"}, 2),
    ("fsdp+rows", {"strategy": "fsdp+rows"}, 2),
    ("fsdp+rows", {"strategy": "fsdp+rows"}, 4),
)
MIB = 2**20
_MEMORY = ("baseline", "crown_peak", "alpha_peak", "bab_peak")
_TITLES = {"baseline": "baseline", "crown_peak": "CROWN peak", "alpha_peak": "α-CROWN peak", "bab_peak": "BaB peak"}


def random_mlp(widths: tuple[int, ...], inputs: int = 784, outputs: int = 10, seed: int = 0) -> BoundGraph:
    """A ReLU MLP with Gaussian weights scaled by ``1/√fan_in`` and small biases.

    Example::

        graph = random_mlp((1024,) * 4)   # 784 → 1024 ×4 → 10
    """
    generator = torch.Generator().manual_seed(seed)
    nodes, previous, fan_in = [Node("x", None, (), (inputs,))], "x", inputs
    for k, width in enumerate((*widths, outputs)):
        weight = torch.randn(width, fan_in, generator=generator) * fan_in**-0.5
        bias = 0.1 * torch.randn(width, generator=generator)
        nodes.append(Node(f"fc{k}", Linear(weight, bias), (previous,), (width,)))
        previous, fan_in = f"fc{k}", width
        if k < len(widths):
            nodes.append(Node(f"relu{k}", ReLU(), (previous,), (width,)))
            previous = f"relu{k}"
    return BoundGraph(nodes)


def _networks(quick: bool) -> dict[str, BoundGraph]:
    nets = {name: random_mlp(widths) for name, widths in (QUICK_MLPS if quick else WIDE_MLPS).items()}
    for size in ("256x2",) if quick else ("256x2", "256x4", "256x6"):
        path = MNIST / f"mnist-net_{size}.onnx"
        if path.exists():
            nets[f"mnist-{size}"] = load_onnx(path)
    return nets


def _property(graph: BoundGraph) -> Property:
    center = torch.rand(graph.input.size, generator=torch.Generator().manual_seed(1)).double().numpy()
    with torch.no_grad():
        label = int(graph(torch.as_tensor(center, dtype=graph.dtype).view(1, -1)).argmax())
    return local_robustness(center, EPS, label, graph.output.size)


@dataclass
class MemoryRow:
    """One rank's measurements for one network and strategy (bytes, seconds)."""

    network: str
    strategy: str
    ranks: int
    rank: int
    baseline: int
    crown_peak: int
    alpha_peak: int
    bab_peak: int
    root_time: float
    bab_time: float


def measure(name: str, graph: BoundGraph, strategy: str, plan: ShardPlan, ranks: int, rank: int) -> MemoryRow:
    """One rank's baseline, root and branch-and-bound memory for ``graph`` (already sharded by ``plan``)."""
    phases = CasePhases(graph, _property(graph).cases[0], plan)
    resident = phases.resident_bytes()
    with phases.lockstep():
        start = time.monotonic()
        with PeakMemoryMeter(graph.device, resident) as crown_meter:
            crown_meter.mark_baseline()
            phases.crown()
        with PeakMemoryMeter(graph.device, resident) as alpha_meter:
            root = phases.alpha(ALPHA_ITERATIONS)
        root_time = time.monotonic() - start
        domains = phases.root_domains(root, BAB_DOMAINS)
        start = time.monotonic()
        with PeakMemoryMeter(graph.device, resident + phases.domain_bytes(domains)) as bab_meter:
            phases.bab_batch(domains, BETA_ITERATIONS)
        bab_time = time.monotonic() - start
    return MemoryRow(
        name,
        strategy,
        ranks,
        rank,
        crown_meter.baseline_bytes,
        crown_meter.peak_bytes,
        alpha_meter.peak_bytes,
        bab_meter.peak_bytes,
        root_time,
        bab_time,
    )


def _rank(rank: int, ranks: int, port: int, strategy: str, kwargs: dict, quick: bool, out: str) -> None:
    torch.set_num_threads(1)
    rows = []
    if ranks > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        plan = ShardPlan(group=dist.group.WORLD if ranks > 1 else None, **kwargs)
        for name, graph in _networks(quick).items():
            sharded = plan.shard(graph)
            del graph
            rows.append(asdict(measure(name, sharded, strategy, plan, ranks, rank)))
        Path(out, f"{strategy}-{ranks}-{rank}.json").write_text(json.dumps(rows))
    finally:
        if ranks > 1:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(out: Path, quick: bool) -> list[dict]:
    """Every strategy of :data:`STRATEGIES` on every network, each in its own set of spawned ranks."""
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for strategy, kwargs, ranks in STRATEGIES:
        args = (ranks, _free_port(), strategy, kwargs, quick, str(out))
        mp.start_processes(_rank, args=args, nprocs=ranks, start_method="spawn")
        for rank in range(ranks):
            path = out / f"{strategy}-{ranks}-{rank}.json"
            rows += json.loads(path.read_text())
            path.unlink()
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """The largest rank of every (network, strategy, P), with ratios to the single-process run."""
    worst: dict[tuple, dict] = {}
    for row in rows:
        key = (row["network"], row["strategy"], row["ranks"])
        mine = worst.setdefault(key, dict(row))
        for field in (*_MEMORY, "root_time", "bab_time"):
            mine[field] = max(mine[field], row[field])
    table = []
    for (network, strategy, ranks), row in worst.items():
        single = worst[(network, "single", 1)]
        ratios = {f"{field}_ratio": row[field] / single[field] for field in _MEMORY}
        table.append(
            {
                **row,
                **ratios,
                "time_ratio": (row["root_time"] + row["bab_time"]) / (single["root_time"] + single["bab_time"]),
            }
        )
    return table


def format_table(table: list[dict]) -> str:
    """Markdown: MiB and the ratio to single for every memory figure, then the time."""
    header = "| network | strategy | P | " + " | ".join(f"{_TITLES[f]} MiB | ×" for f in _MEMORY) + " | time s | × |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in table:
        cells = [r["network"], r["strategy"], str(r["ranks"])]
        cells += [f"{r[f] / MIB:.1f} | {r[f + '_ratio']:.2f}" for f in _MEMORY]
        cells += [f"{r['root_time'] + r['bab_time']:.2f} | {r['time_ratio']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(_MEMORY), figsize=(20, 4.2))
    top = max(1.15, max(r[f"{field}_ratio"] for r in table for field in _MEMORY) + 0.05)
    for axis, field in zip(axes, _MEMORY, strict=True):
        title = _TITLES[field]
        for network in dict.fromkeys(r["network"] for r in table):
            for strategy, style in (("fsdp", "-o"), ("tp-rows", "--s"), ("fsdp+rows", "-.^")):
                points = sorted(
                    (r["ranks"], r[f"{field}_ratio"])
                    for r in table
                    if r["network"] == network and r["strategy"] in (strategy, "single")
                )
                axis.plot(*zip(*points, strict=True), style, label=f"{network} {strategy}")
        axis.plot([1, 2, 4], [1, 0.5, 0.25], ":", color="grey", label="1/P")
        axis.set(title=title, xlabel="ranks P", ylabel="memory / single", xticks=[1, 2, 4], ylim=(0, top))
    axes[0].legend(fontsize=6, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _auto_lirpa_process(_: int, quick: bool, out: str) -> None:
    """auto_LiRPA on every network, in a process of its own with one thread, as the ranks run."""
    from lightning_fedshard.bench.lirpa_reference import auto_lirpa_peaks

    torch.set_num_threads(1)
    rows = []
    for name, graph in _networks(quick).items():
        prop = _property(graph)
        theirs = auto_lirpa_peaks(graph, prop, ALPHA_ITERATIONS)
        ours = CasePhases(graph, prop.cases[0]).crown()
        theirs["crown_max_diff"] = float((torch.tensor(theirs.pop("crown_margins")) - ours).abs().max())
        rows.append({"network": name, **theirs})
    Path(out, "auto_lirpa.json").write_text(json.dumps(rows))


def run_auto_lirpa(out: Path, quick: bool) -> list[dict]:
    """auto_LiRPA's single-process peaks on the same networks and properties (see ``lirpa_reference``)."""
    mp.start_processes(_auto_lirpa_process, args=(quick, str(out)), nprocs=1, start_method="spawn")
    return json.loads((out / "auto_lirpa.json").read_text())


def format_auto_lirpa(table: list[dict], theirs: list[dict]) -> str:
    """Markdown: our single-process CROWN and α-CROWN peaks against auto_LiRPA's, MiB and ours/theirs."""
    ours = {r["network"]: r for r in table if r["strategy"] == "single"}
    lines = [
        "| network | weights MiB | CROWN peak: ours | auto_LiRPA | ours/theirs | α-CROWN peak: ours "
        "| auto_LiRPA | ours/theirs | auto_LiRPA, fixed intermediate bounds | CROWN margins max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in theirs:
        mine = ours[row["network"]]
        cells = [row["network"], f"{row['baseline'] / MIB:.1f}"]
        for field in ("crown", "alpha"):
            cells += [f"{mine[f'{field}_peak'] / MIB:.1f}", f"{row[f'{field}_peak'] / MIB:.1f}"]
            cells.append(f"{mine[f'{field}_peak'] / row[f'{field}_peak']:.2f}")
        cells += [f"{row['alpha_fixed_peak'] / MIB:.1f}", f"{row['crown_max_diff']:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench verify-memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/verify-memory"))
    parser.add_argument("--quick", action="store_true", help="one small MLP and 256x2 only (a smoke run)")
    parser.add_argument(
        "--auto-lirpa",
        action="store_true",
        help="also measure auto_LiRPA's single-process CROWN and α-CROWN peaks (install it first: see the docs)",
    )
    args = parser.parse_args(argv)
    if args.auto_lirpa and importlib.util.find_spec("auto_LiRPA") is None:
        parser.error("--auto-lirpa: auto_LiRPA is not importable (see lightning_fedshard/bench/lirpa_reference.py)")
    rows = run(args.out, args.quick)
    table = summarise(rows)
    print(format_table(table))
    theirs = run_auto_lirpa(args.out, args.quick) if args.auto_lirpa else []
    if theirs:
        print("\nauto_LiRPA 0.7.1, single process, the same meter:\n" + format_auto_lirpa(table, theirs))
    (args.out / "results.json").write_text(json.dumps({"ranks": rows, "table": table, "auto_lirpa": theirs}, indent=1))
    plot(table, args.out / "memory_vs_ranks.png")
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'memory_vs_ranks.png'}")


if __name__ == "__main__":
    main()
