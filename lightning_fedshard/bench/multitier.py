"""The tiny Llama recipes on a real two-tier network: nodes as network namespaces, shaped links between them.

``fedshard bench multitier`` builds 2 nodes × 2 ranks out of network namespaces
(:class:`~lightning_fedshard.bench.netns.NamespaceCluster`), launches one ``torchrun`` per node, so that
traffic inside a node stays on its loopback and traffic between nodes crosses ``tc``-shaped links, and runs
fsdp2, hsdp, fl_fsdp and fl_hsdp (and the FL variants with DynamiQ on the cross-group average) at several
link rates. It reports tokens/s, the strategies' ledger bytes per tier, the bytes that really left each node
(kernel counters), validation loss, ratios to hsdp, and the cost model's predicted step time next to the
measured one. The machine's side of the cost model (compute rate, loopback bandwidth, gloo latencies, codec
speed) is calibrated first on the unshaped cluster by a separate torchrun job; nothing of the training
runs themselves goes into the prediction. With ``--profile`` each run's steps are also broken into compute,
collectives and a fragment average's send, wait and apply (:mod:`~lightning_fedshard.bench.step_profile`), with
the main thread's CPU time, gloo's threads' and how busy each core was. Needs root and iproute2; says why and exits
otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

from lightning_fedshard.bench.costmodel import (
    Cluster,
    ShardedSizes,
    Workload,
    mean_step_bytes,
    node_egress_bytes,
    step_time,
)
from lightning_fedshard.bench.netns import ClusterUnavailable, NamespaceCluster, check_available
from lightning_fedshard.bench.recipes import TINY, fit_arguments, metrics_path, read_metrics, summarize
from lightning_fedshard.bench.step_profile import format_by_position, format_profiles, mean_profile, read_profiles
from lightning_fedshard.dynamiq.settings import Compression
from lightning_fedshard.strategies import FedShardDims, partition_fragments
from lightning_fedshard.strategies.apply import fsdp_units
from lightning_fedshard.strategies.ledger import TIERS
from lightning_fedshard.strategies.streaming import FragmentSchedule

__all__ = ["NODES", "RANKS_PER_NODE", "LinkBytesMonitor", "Run", "machine_cluster", "main", "recipe_workload"]

NODES, RANKS_PER_NODE = 2, 2
#: Streaming sync for the "+streaming" runs: the recipes' 8-step round as 2 fragments, each in flight for 3 steps
#: of compute before it is applied half-and-half with the local shards.
STREAMING = {"sync_schedule": "streaming", "fragments": 2, "fragment_sync_delay": 3, "fragment_update_alpha": 0.5}
#: (name, recipe, cross-group DynamiQ bits or None, strategy arguments); hsdp first: the baseline of every ratio.
RUNS = (
    ("hsdp", "hsdp", None, {}),
    ("fsdp2", "fsdp2", None, {}),
    ("fl_fsdp", "fl_fsdp", None, {}),
    ("fl_hsdp", "fl_hsdp", None, {}),
    ("fl_fsdp+dynamiq", "fl_fsdp", 5.0, {}),
    ("fl_hsdp+dynamiq", "fl_hsdp", 5.0, {}),
    ("fl_fsdp+streaming", "fl_fsdp", None, STREAMING),
    ("fl_hsdp+streaming", "fl_hsdp", None, STREAMING),
)
_PORT = 29731


@dataclass
class Run:
    name: str
    rate_mbit: float
    tokens_per_s: float
    val_loss: float
    ledger_bytes: dict[str, float]
    """Mean bytes one rank sends per step, per mesh tier, as the strategy's ledger logged them."""
    node_egress_bytes: float
    """Bytes per step that left node 0 through its link (kernel counter, headers included, training steps only)."""
    measured_step_s: float
    predicted_step_s: float
    predicted_egress_bytes: float
    predicted_ledger_bytes: dict[str, float]
    profile: dict[str, Any] | None = None
    """With ``--profile``: :func:`~lightning_fedshard.bench.step_profile.mean_profile` of the run's ranks."""


# ---- the cost model's view of a recipe and of this machine ------------------------------------------------


def recipe_workload(
    config_path: Path,
    fed_bits: float | None = None,
    dims: FedShardDims | None = None,
    strategy_args: dict[str, Any] | None = None,
) -> Workload:
    """The tiny recipe ``config_path`` as a :class:`Workload` (its mesh, model, batch, sync interval and schedule);
    ``dims`` replaces the recipe's mesh, and the shards are sized for it; ``strategy_args`` override the recipe's."""
    import torch
    from torch import nn

    from lightning_fedshard.models import Llama, LlamaConfig, TransformerBlock

    config = yaml.safe_load(config_path.read_text())
    init = {**config["trainer"]["strategy"]["init_args"], **(strategy_args or {})}
    dims = dims or FedShardDims(init.get("num_groups", 1), init.get("replicate_size", 1), init["shard_size"])
    llama = LlamaConfig.from_name(config["model"]["preset"])
    holder = nn.Module()
    with torch.device("meta"):  # only the shapes count
        holder.model = Llama(llama)  # the LightningModule's one child with parameters
    seq_len, batch = config["data"]["seq_len"], config["data"]["batch_size"]
    shares: tuple[float, ...] = (1.0,)
    if init.get("sync_schedule") == "streaming":
        named = list(holder.named_parameters())
        fragments = partition_fragments(holder, named, init["fragments"], fsdp_units(holder, [TransformerBlock]))
        total = sum(p.numel() for _, p in named)
        shares = tuple(sum(named[i][1].numel() for i in fragment) / total for fragment in fragments)
    return Workload(
        dims,
        ShardedSizes.of_module(holder, dims.shard_size, auto_wrap=[TransformerBlock]),
        sync_every=init.get("sync_every", 8),
        fed_compression=Compression(bits=fed_bits) if fed_bits is not None else None,
        tokens_per_step=seq_len * batch,
        flops_per_token=llama.flops_per_token(seq_len),
        fragment_shares=shares,
        fragment_sync_delay=init.get("fragment_sync_delay", 0),
    )


def machine_cluster(calibration: dict[str, float], rate_mbit: float, mtu: int = 1500) -> Cluster:
    """This machine as a :class:`Cluster`: calibrated compute, loopback and latencies; the link's rate less
    TCP/IP and Ethernet headers (tbf counts whole frames: ``mtu - 52`` payload bytes per ``mtu + 14``)."""
    return Cluster(
        name=f"netns {NODES}×{RANKS_PER_NODE} at {rate_mbit:g} Mbit/s",
        devices_per_node=RANKS_PER_NODE,
        peak_flops=calibration["flops_per_s"],
        mfu=1.0,
        intra_node_bandwidth=calibration["loopback_bytes_per_s"],
        inter_node_bandwidth=rate_mbit * 1e6 / 8 * (mtu - 52) / (mtu + 14),
        intra_node_latency=0.0,
        inter_node_latency=calibration["inter_node_hop_s"],
        call_latency=calibration["call_s"],
        reduce_scatter_factor=2.0,  # gloo reduce-scatters by all-reducing, then slicing (checked on the wire)
        codec_seconds_per_coord=calibration["codec_s_per_coord"],
        overlap=False,
        sources=("calibrated by `fedshard bench multitier` on the unshaped namespace cluster",),
    )


# ---- counting what crosses the link during training steps --------------------------------------------------


class LinkBytesMonitor(Callback):
    """Counts the bytes its node's link sends during training, validation and set-up excluded, and writes
    ``{"bytes": ..., "steps": ...}`` to ``<directory>/node<N>.json`` (local rank 0 of each node reads the
    kernel counter of ``interface``, which every process of the namespace shares).

    Example::

        trainer = Trainer(callbacks=[LinkBytesMonitor("runs/link")], ...)  # inside a NamespaceCluster node
    """

    def __init__(self, directory: str, interface: str = "eth0") -> None:
        self.directory = Path(directory)
        self.counter = Path(f"/sys/class/net/{interface}/statistics/tx_bytes")
        self.sent = 0
        self._since: int | None = None

    def _mark(self, trainer: pl.Trainer, counting: bool) -> None:
        """Ends the counted span, or starts one. The barrier first: a link is one FIFO queue, so once the
        barrier's message has crossed, every byte this node queued before it has been sent and counted."""
        trainer.strategy.barrier()
        if trainer.local_rank != 0:
            return
        now = int(self.counter.read_text())
        if self._since is not None:
            self.sent += now - self._since
        self._since = now if counting else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(trainer, counting=True)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._mark(trainer, counting=False)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._mark(trainer, counting=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark(trainer, counting=False)
        if trainer.local_rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            record = {"bytes": self.sent, "steps": trainer.global_step}
            (self.directory / f"node{trainer.node_rank}.json").write_text(json.dumps(record))


# ---- calibration (runs under torchrun inside the namespaces) ------------------------------------------------


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate_worker(out: Path) -> None:
    """Per rank, all ranks at once: gloo calls of one element (latency) and of 4 MiB (loopback bandwidth),
    inside a node and across nodes, and DynamiQ's decompress-accumulate-recompress per coordinate."""
    import torch
    import torch.distributed as dist

    from lightning_fedshard.dynamiq.codec import make_codec

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node_groups = [dist.new_group(list(range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE))) for n in range(NODES)]
    cross_groups = [dist.new_group(list(range(r, world, RANKS_PER_NODE))) for r in range(RANKS_PER_NODE)]
    intra, cross = node_groups[rank // RANKS_PER_NODE], cross_groups[rank % RANKS_PER_NODE]
    one, big = torch.zeros(1), torch.zeros(1 << 20)
    dist.barrier()
    call_s = _median_seconds(lambda: dist.all_reduce(one, group=intra), 50)
    cross_call_s = _median_seconds(lambda: dist.all_reduce(one, group=cross), 50)
    loopback_s = _median_seconds(lambda: dist.all_reduce(big, group=intra), 10)
    codec = make_codec("dynamiq", 5.0)
    x, y = torch.randn(1 << 18), torch.randn(1 << 18)
    message = codec.encode(x, 1)
    codec_s = _median_seconds(lambda: codec.accumulate(message, y, 1), 10)
    pair_bytes = 2 * (RANKS_PER_NODE - 1) / RANKS_PER_NODE * big.numel() * 4  # one rank's share of the all-reduce
    result = {
        "call_s": call_s,
        # a 2-rank all-reduce makes 2 hops; what crossing nodes adds is the hops' latency
        "inter_node_hop_s": max(cross_call_s - call_s, 0.0) / 2,
        "loopback_bytes_per_s": pair_bytes / max(loopback_s - call_s, 1e-9),
        "codec_s_per_coord": codec_s / x.numel(),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        out.write_text(json.dumps({k: statistics.median(r[k] for r in gathered) for k in result}, indent=2))
    dist.barrier()
    dist.destroy_process_group()


# ---- launching ------------------------------------------------------------------------------------------


def _torchrun(cluster: NamespaceCluster, node_args: list[list[str]], log: Path, port: int, joint: bool = True) -> None:
    """One torchrun per node namespace, ``RANKS_PER_NODE`` ranks each, node ``i`` running ``node_args[i]``:
    one job over all nodes (``joint``), or one job per node. Raises with the log tail on failure."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": cluster.nodes[0].interface, "OMP_NUM_THREADS": "1"}
    procs = []
    for node, args in zip(cluster.nodes, node_args, strict=True):
        nodes, rank, master = (NODES, node.index, cluster.nodes[0].address) if joint else (1, 0, node.address)
        command = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={nodes}", f"--node-rank={rank}", f"--nproc-per-node={RANKS_PER_NODE}",
            f"--master-addr={master}", f"--master-port={port}",
            *args,
        ]  # fmt: skip
        out = log.with_suffix(f".node{node.index}.log").open("w")
        procs.append((cluster.popen(node.index, command, stdout=out, stderr=out, env=env), out))
    codes = []
    for proc, out in procs:
        codes.append(proc.wait())
        out.close()
    if any(codes):
        tail = log.with_suffix(".node0.log").read_text()[-4000:]
        raise RuntimeError(f"{' '.join(node_args[0][:4])} failed (exit codes {codes}); end of node 0's log:\n{tail}")


def calibrate(cluster: NamespaceCluster, args: argparse.Namespace) -> dict[str, float]:
    """The machine's side of the cost model, on the unshaped cluster: gloo latencies, loopback bandwidth and
    codec speed from micro-benchmarks; the compute rate from the tiny fsdp2 recipe run on every node at
    once, each node its own 2-rank job (the same load per core, no traffic between nodes), less what the
    model says its loopback traffic costs."""
    cluster.set_rate(None)
    out = args.out / "calibration"
    out.mkdir(parents=True, exist_ok=True)
    worker = ["-m", "lightning_fedshard.bench.multitier", "--calibrate-worker", str(out / "comm.json")]
    _torchrun(cluster, [worker] * NODES, out / "comm.log", _PORT)
    calibration = json.loads((out / "comm.json").read_text())
    config = TINY / "fsdp2.yaml"
    overrides = [
        "--trainer.num_nodes=1",
        f"--trainer.devices={RANKS_PER_NODE}",
        f"--trainer.strategy.init_args.shard_size={RANKS_PER_NODE}",
        f"--trainer.max_steps={args.steps}",
        f"--trainer.val_check_interval={args.steps}",
        "--trainer.limit_val_batches=1",
    ]
    names = [f"compute-node{n}" for n in range(NODES)]
    _torchrun(
        cluster,
        [["-m", "lightning_fedshard.cli", *fit_arguments(config, out, overrides, name)] for name in names],
        out / "compute.log",
        _PORT + 1,
        joint=False,
    )
    rates = [summarize(name, read_metrics(metrics_path(out, name))).tokens_per_s for name in names]
    workload = recipe_workload(config, dims=FedShardDims(1, 1, RANKS_PER_NODE))
    step_s = workload.dims.world_size * workload.tokens_per_step / statistics.mean(rates)
    comm_only = machine_cluster({**calibration, "flops_per_s": math.inf}, rate_mbit=1.0)
    compute_s = step_s - step_time(workload, comm_only).total
    calibration.update(compute_s=compute_s, flops_per_s=workload.tokens_per_step * workload.flops_per_token / compute_s)
    return calibration


def run_one(
    cluster: NamespaceCluster,
    name: str,
    recipe: str,
    fed_bits: float | None,
    strategy_args: dict[str, Any],
    rate_mbit: float,
    calibration: dict[str, float],
    args: argparse.Namespace,
    port: int,
) -> Run:
    config = TINY / f"{recipe}.yaml"
    label = f"{name}@{rate_mbit:g}mbit"
    overrides = [
        f"--trainer.num_nodes={NODES}",
        f"--trainer.devices={RANKS_PER_NODE}",
        f"--trainer.max_steps={args.steps}",
        f"--trainer.val_check_interval={args.steps // 2}",
        f"--trainer.limit_val_batches={args.val_batches}",
        *(f"--trainer.strategy.init_args.{key}={value}" for key, value in strategy_args.items()),
    ]
    if fed_bits is not None:
        plugin = {"class_path": "lightning_fedshard.DynamiQ", "init_args": {"bits": fed_bits, "traffic": ["fed"]}}
        # the plugin composes with the recipe's precision, which Lightning then must not see twice
        plugin["init_args"]["precision"] = yaml.safe_load(config.read_text())["trainer"]["precision"]
        overrides += [f"--trainer.plugins={json.dumps([plugin])}", "--trainer.precision=null"]
    link_dir = args.out / label / "link"
    monitor = {
        "class_path": "lightning_fedshard.bench.multitier.LinkBytesMonitor",
        "init_args": {"directory": str(link_dir)},
    }
    overrides.append(f"--trainer.callbacks+={json.dumps(monitor)}")
    profile_dir = args.out / label / "profile"
    if args.profile:
        profiler = {
            "class_path": "lightning_fedshard.bench.step_profile.StepProfiler",
            "init_args": {"directory": str(profile_dir)},
        }
        overrides.append(f"--trainer.callbacks+={json.dumps(profiler)}")
    fit = ["-m", "lightning_fedshard.cli", *fit_arguments(config, args.out, overrides, label)]
    _torchrun(cluster, [fit] * NODES, args.out / f"{label}.log", port)
    link = json.loads((link_dir / "node0.json").read_text())
    egress = link["bytes"] / link["steps"]
    result = summarize(label, read_metrics(metrics_path(args.out, label)))
    workload = recipe_workload(config, fed_bits, strategy_args=strategy_args)
    machine = machine_cluster(calibration, rate_mbit, cluster.mtu)
    predicted = step_time(workload, machine)
    return Run(
        name=name,
        rate_mbit=rate_mbit,
        tokens_per_s=result.tokens_per_s,
        val_loss=result.val_curve[-1]["val_loss"],
        ledger_bytes=result.bytes_per_step,
        node_egress_bytes=egress,
        measured_step_s=workload.dims.world_size * workload.tokens_per_step / result.tokens_per_s,
        predicted_step_s=predicted.total,
        predicted_egress_bytes=node_egress_bytes(workload, machine),
        predicted_ledger_bytes=mean_step_bytes(workload),
        profile=mean_profile(read_profiles(profile_dir)) if args.profile else None,
    )


# ---- report ---------------------------------------------------------------------------------------------


def format_table(runs: list[Run]) -> str:
    lines = [
        (
            "tokens/s: all ranks, training steps; ledger B/step: one rank, per tier; egress: bytes node 0 sent to the"
            " other node per training step (kernel counter, validation excluded) against the model's wire bytes"
        ),
    ]
    for rate in sorted({r.rate_mbit for r in runs}):
        at_rate = [r for r in runs if r.rate_mbit == rate]
        base = next(r for r in at_rate if r.name == "hsdp")
        lines += [
            "",
            f"link {rate:g} Mbit/s",
            f"{'strategy':<16} {'tokens/s':>8} {'×hsdp':>6} {'val loss':>8} "
            + " ".join(f"{t + ' B':>12}" for t in TIERS)
            + f" {'egress MB':>9} {'model MB':>8} {'step s':>7} {'model s':>7} {'error':>6}",
        ]
        for r in at_rate:
            error = r.predicted_step_s / r.measured_step_s - 1
            lines.append(
                f"{r.name:<16} {r.tokens_per_s:8.0f} {r.tokens_per_s / base.tokens_per_s:6.2f} {r.val_loss:8.4f} "
                + " ".join(f"{r.ledger_bytes[t]:12,.0f}" for t in TIERS)
                + f" {r.node_egress_bytes / 1e6:9.3f} {r.predicted_egress_bytes / 1e6:8.3f}"
                f" {r.measured_step_s:7.3f} {r.predicted_step_s:7.3f} {error:+6.1%}"
            )
        lines.append(f"  ratios to hsdp at {rate:g} Mbit/s:")
        for r in at_rate:
            lines.append(
                f"    {r.name:<16} tokens/s ×{r.tokens_per_s / base.tokens_per_s:.2f}"
                f"   val loss ×{r.val_loss / base.val_loss:.3f}"
                f"   ledger bytes/step ×{sum(r.ledger_bytes.values()) / sum(base.ledger_bytes.values()):.3f}"
                f"   link bytes/step ×{r.node_egress_bytes / base.node_egress_bytes:.3f}"
            )
    fastest = max(r.rate_mbit for r in runs)
    own = {r.name: r for r in runs if r.rate_mbit == fastest}
    lines += ["", f"each run against itself at {fastest:g} Mbit/s:"]
    for r in runs:
        if r.rate_mbit != fastest and r.name in own:
            lines.append(
                f"    {r.name:<18} at {r.rate_mbit:g} Mbit/s:"
                f" tokens/s ×{r.tokens_per_s / own[r.name].tokens_per_s:.3f}"
                f"   val loss ×{r.val_loss / own[r.name].val_loss:.4f}"
            )
    worst = max(abs(r.predicted_step_s / r.measured_step_s - 1) for r in runs)
    lines += ["", f"largest step-time error of the cost model: {worst:.1%}"]
    for rate in sorted({r.rate_mbit for r in runs if r.profile}):
        profiles = {r.name: r.profile for r in runs if r.rate_mbit == rate and r.profile}
        lines += ["", f"step profile at {rate:g} Mbit/s", format_profiles(profiles)]
    schedule = _streaming_schedule()
    names = {}
    for step in range(1, schedule.interval + 1):
        if schedule.starting(step) is not None:
            names[step % schedule.interval] = "(sends after it)"
        if schedule.finishing(step) is not None:
            names[step % schedule.interval] = "(applies after it)"
    for rate in sorted({r.rate_mbit for r in runs if r.profile}):
        profiles = {r.name: r.profile for r in runs if r.rate_mbit == rate and r.profile and "streaming" in r.name}
        if profiles:
            lines += [
                "",
                f"streaming steps by their place in the fragment schedule at {rate:g} Mbit/s (wall ms, mean of ranks)",
                format_by_position(profiles, schedule.interval, names),
            ]
    return "\n".join(lines)


def _streaming_schedule() -> FragmentSchedule:
    """The schedule of the "+streaming" runs: :data:`STREAMING` on the FL recipes' sync interval."""
    sync_every = yaml.safe_load((TINY / "fl_fsdp.yaml").read_text())["trainer"]["strategy"]["init_args"]["sync_every"]
    return FragmentSchedule.create(
        sync_every=sync_every, fragments=STREAMING["fragments"], delay=STREAMING["fragment_sync_delay"],
        alpha=STREAMING["fragment_update_alpha"], owner="multitier.STREAMING",
    )  # fmt: skip


def plot(runs: list[Run], out_dir: Path) -> list[Path]:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.name for r in runs))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name in names:
        mine = sorted((r for r in runs if r.name == name), key=lambda r: r.rate_mbit)
        style = "--" if "dynamiq" in name else ":" if "streaming" in name else "-"
        ax.plot([r.rate_mbit for r in mine], [r.tokens_per_s for r in mine], style, marker="o", label=name)
    ax.set(xscale="log", xlabel="link rate between nodes (Mbit/s)", ylabel="tokens/s (all ranks)")
    ax.set_title(f"tiny Llama 3.1, {NODES} nodes × {RANKS_PER_NODE} ranks, shaped links")
    throughput = _save(fig, ax, out_dir / "multitier_throughput.png")

    fig, ax = plt.subplots(figsize=(5, 5))
    times = [t for r in runs for t in (r.measured_step_s, r.predicted_step_s)]
    low, high = min(times) / 1.3, max(times) * 1.3
    ax.plot([low, high], [low, high], "k-", lw=0.8, label="equal")
    ax.fill_between([low, high], [0.75 * low, 0.75 * high], [1.25 * low, 1.25 * high], color="grey", alpha=0.15,
                    label="±25 %")  # fmt: skip
    for name in names:
        mine = [r for r in runs if r.name == name]
        ax.scatter([r.measured_step_s for r in mine], [r.predicted_step_s for r in mine], label=name, s=25)
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="measured step time (s)",
           ylabel="cost model (s)")  # fmt: skip
    ticks = [t for t in (0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 10, 20) if low <= t <= high]
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
        axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    return [throughput, _save(fig, ax, out_dir / "multitier_measured_vs_model.png")]


def _save(fig, ax, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench multitier", description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[50.0, 200.0, 1000.0], help="link rates, Mbit/s")
    parser.add_argument("--runs", nargs="+", default=[name for name, *_ in RUNS], help="which of the runs")
    parser.add_argument(
        "--steps", type=int, default=32, help="optimizer steps per run (validated half-way and at the end)"
    )
    parser.add_argument("--val-batches", type=int, default=4)
    parser.add_argument(
        "--profile", action="store_true", help="break each run's steps into compute, collectives, sends and waits"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench-multitier"))
    parser.add_argument("--from-results", type=Path, help="print the table and redraw the plots of a results.json")
    parser.add_argument("--calibrate-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.calibrate_worker:
        calibrate_worker(args.calibrate_worker)
        return
    if args.from_results:
        runs = [Run(**r) for r in json.loads(args.from_results.read_text())["runs"]]
        print(format_table(runs))
        print("\nplots: " + ", ".join(map(str, plot(runs, args.from_results.parent))))
        return
    unknown = set(args.runs) - {name for name, *_ in RUNS}
    if unknown or "hsdp" not in args.runs:
        parser.error(f"--runs must name runs of {[n for n, *_ in RUNS]} and include the hsdp baseline")
    if args.steps < 16 or args.steps % 16 or min(args.rates) <= 0:
        parser.error("--steps must be a positive multiple of 16 (two syncs of 8 per half) and rates positive")
    try:
        check_available()
    except ClusterUnavailable as why:
        sys.exit(f"fedshard bench multitier cannot build its network here: {why}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    with NamespaceCluster(NODES) as cluster:
        calibration = calibrate(cluster, args)
        print("calibration:", json.dumps(calibration), flush=True)
        port = _PORT
        for rate in args.rates:
            cluster.set_rate(rate)
            for name, recipe, bits, strategy_args in RUNS:
                if name in args.runs:
                    port += 1
                    print(f"{rate:g} Mbit/s: {name} ...", flush=True)
                    runs.append(run_one(cluster, name, recipe, bits, strategy_args, rate, calibration, args, port))
    print(format_table(runs))
    pngs = plot(runs, args.out)
    (args.out / "results.json").write_text(
        json.dumps({"calibration": calibration, "runs": [asdict(r) for r in runs]}, indent=2)
    )
    print("\nplots: " + ", ".join(map(str, pngs)) + f"\nresults: {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
