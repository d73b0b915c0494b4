"""The FL+FSDP paper's quality claim, measured: validation perplexity of hsdp against fl_hsdp at equal steps,
tokens and (modelled) wall time, as the world grows and every rank keeps the same hyperparameters.

The paper (Mittone & Aldinucci, EuroPar 2026) reports "4.48 lower evaluation perplexity" for FL+FSDP/FL+HSDP
"under identical hyperparameters": a baseline's global batch is ``W·b`` and grows with the world size ``W``,
while a federation group's stays ``W·b/F``. Here the tiny Llama 3.1 recipe (``recipes/tiny/hsdp.yaml``'s
model, optimizer and data) trains with the same micro-batch ``b``, learning rate, schedule and sync interval
everywhere; a world of ``W`` ranks is ``P`` real processes, each accumulating ``W/P`` micro-batches per
optimizer step (Lightning's ``accumulate_grad_batches`` under the same strategies), so every layout consumes
``W·b`` samples per step. FL needs ``F ≤ P`` groups. FedAvg and DiLoCo are the strategies'
``outer_optimizer="avg"`` and ``"nesterov"``.

Equal wall time comes from :mod:`lightning_fedshard.bench.costmodel`: the ``W`` ranks stand for the paper's 512
A100s and ``F`` groups stay ``F`` groups (fl_hsdp ``F×(128/F)×4`` against hsdp ``1×128×4``, and fl_fsdp
``F×1×(512/F)`` against fsdp2 ``1×1×512``, which train the same trajectories as fl_hsdp and hsdp: sharding
changes where the parameters live, not the update). The learning rate is constant after warm-up
(``min_lr_ratio=1``), so a curve's value at any step is what a run stopped there reaches.

``fedshard bench quality`` runs the grid (one launch of ``P`` processes trains all its runs in turn) and writes
``results.json``, ``quality.md`` and ``quality.png`` under ``--out``; ``--analyse`` redoes the tables and the
plot from the runs finished there so far.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from lightning_fedshard.bench.recipes import TINY

__all__ = [
    "QualityRun",
    "RunSpec",
    "at_step",
    "at_tokens",
    "break_even_speedup",
    "equal_time_steps",
    "format_tables",
    "grid",
    "main",
    "step_seconds",
]

BASELINE = "hsdp"
#: Paired layouts at 512 GPUs, as :mod:`~lightning_fedshard.bench.costmodel` names them.
PAIRS = {"fl_hsdp": "hsdp", "fl_fsdp": "fsdp2"}
OUTERS = {"avg": "FedAvg", "nesterov": "DiLoCo"}


@dataclass(frozen=True)
class RunSpec:
    """One training run: ``world`` ranks as ``processes`` processes × ``world // processes`` accumulated
    micro-batches, split into ``groups`` federation groups (1: the hsdp baseline).

    Example::

        RunSpec(world=16, groups=4, outer="nesterov", seed=0, processes=4).name  # 'W16-F4-nesterov-s0'
    """

    world: int
    groups: int
    outer: str | None
    seed: int
    processes: int

    def __post_init__(self) -> None:
        if self.world % self.processes or self.processes % self.groups:
            raise ValueError(f"{self}: need processes | world and groups | processes.")
        if (self.groups == 1) != (self.outer is None):
            raise ValueError(f"{self}: the baseline (groups=1) has no outer optimizer; FL runs need one.")

    @property
    def accumulate(self) -> int:
        return self.world // self.processes

    @property
    def config(self) -> str:
        """The run's name without the seed: runs that differ only by seed share it."""
        outer = "" if self.outer is None else f"-{self.outer}"
        return f"W{self.world}-F{self.groups}{outer}" + (
            "" if self.processes in (4, self.world) else f"-P{self.processes}"
        )

    @property
    def name(self) -> str:
        return f"{self.config}-s{self.seed}"


@dataclass
class QualityRun:
    spec: RunSpec
    tokens_per_step: int
    """Tokens one optimizer step consumes, all ranks together: ``W·b·seq_len``."""
    curve: list[dict[str, float]] = field(default_factory=list)
    """``{"step", "val_loss"}`` after every ``val_every`` optimizer steps."""
    seconds: float = math.nan
    """This machine's wall time for the run (CPU, shared; shown only to size the grid)."""


def grid(
    worlds: Sequence[int], seeds: Sequence[int], outers: Sequence[str], processes: int = 4, wide: int = 8
) -> list[RunSpec]:
    """hsdp and fl_hsdp with ``F = 2`` and ``F = W/4`` groups (capped by the processes available) for every world
    size; worlds up to ``wide`` run as real processes, larger ones as ``processes`` processes accumulating."""
    specs = []
    for seed in seeds:  # seed by seed: an interrupted grid leaves whole seeds behind (runs resume by name)
        for world in worlds:
            procs = world if world <= wide else processes
            specs.append(RunSpec(world, 1, None, seed, procs))
            for groups in sorted({2, min(max(world // 4, 2), procs)}):
                specs += [RunSpec(world, groups, outer, seed, procs) for outer in outers]
    return specs


# ---- training: one launch of P processes runs every spec with that P --------------------------------------


def _recipe() -> dict:
    return yaml.safe_load((TINY / "hsdp.yaml").read_text())


def _strategy(spec: RunSpec, sync_every: int):
    from lightning_fedshard import FLFSDPStrategy, FLHSDPStrategy
    from lightning_fedshard.models import TransformerBlock

    wrap = [TransformerBlock]
    if spec.groups == 1:  # the tiny hsdp recipe's layout, replicas × 2 shards (fsdp2 below 2 replicas)
        if spec.processes < 4:
            return FLFSDPStrategy(num_groups=1, shard_size=spec.processes, auto_wrap=wrap)
        return FLHSDPStrategy(num_groups=1, replicate_size=spec.processes // 2, shard_size=2, auto_wrap=wrap)
    per_group = spec.processes // spec.groups
    fl = {"num_groups": spec.groups, "sync_every": sync_every, "outer_optimizer": spec.outer, "auto_wrap": wrap}
    if per_group == 1:  # fl_hsdp needs two replicas per group; a one-rank group is fl_fsdp over one shard
        return FLFSDPStrategy(shard_size=1, **fl)
    return FLHSDPStrategy(replicate_size=per_group, shard_size=1, **fl)


def _train(spec: RunSpec, settings: dict, out: Path) -> None:
    """One run in this (already launched) world; rank 0 writes its validation curve to ``out/NAME.json``."""
    import lightning.pytorch as pl

    from lightning_fedshard.data import TextDataModule
    from lightning_fedshard.training.pretraining import LlamaPretraining

    recipe = _recipe()
    curve: list[dict[str, float]] = []

    class ValCurve(pl.Callback):
        def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            if not trainer.sanity_checking:
                curve.append({"step": trainer.global_step, "val_loss": float(trainer.callback_metrics["val_loss"])})

    pl.seed_everything(spec.seed, verbose=False)
    data = TextDataModule(
        **{
            **recipe["data"],
            "batch_size": settings["batch"],
            "seed": spec.seed,
            "max_val_samples": settings["val_samples"],
        }
    )
    model = LlamaPretraining(**{**recipe["model"], "seq_len": recipe["data"]["seq_len"], "min_lr_ratio": 1.0})
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=spec.processes,
        strategy=_strategy(spec, settings["sync_every"]),
        precision=recipe["trainer"]["precision"],
        max_steps=settings["steps"],
        accumulate_grad_batches=spec.accumulate,
        val_check_interval=settings["val_every"] * spec.accumulate,  # counted in micro-batches
        check_val_every_n_epoch=None,
        limit_val_batches=1.0,
        num_sanity_val_steps=0,
        gradient_clip_val=recipe["trainer"]["gradient_clip_val"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ValCurve()],
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    if trainer.global_rank == 0:
        tokens = spec.world * settings["batch"] * recipe["data"]["seq_len"]
        run = QualityRun(spec, tokens, curve, time.perf_counter() - start)
        (out / f"{spec.name}.json").write_text(json.dumps(asdict(run)))


def _worker(plan: Path) -> None:
    job = json.loads(plan.read_text())
    out = Path(job["out"])
    for raw in job["specs"]:
        spec = RunSpec(**raw)
        if not (out / f"{spec.name}.json").exists():
            _train(spec, job["settings"], out)


def train(specs: list[RunSpec], settings: dict, out: Path, timeout: float) -> list[QualityRun]:
    """Runs every spec not already done under ``out/runs`` (one launch per process count) and loads them all."""
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    by_processes: dict[int, list[RunSpec]] = defaultdict(list)
    for spec in specs:
        by_processes[spec.processes].append(spec)
    for processes, batch in sorted(by_processes.items(), reverse=True):  # the real-process worlds are the cheap ones
        todo = [s for s in batch if not (runs_dir / f"{s.name}.json").exists()]
        if not todo:
            continue
        plan = out / f"plan-P{processes}.json"
        plan.write_text(json.dumps({"out": str(runs_dir), "settings": settings, "specs": [asdict(s) for s in todo]}))
        print(f"training {len(todo)} runs on {processes} processes ...", flush=True)
        log = out / f"train-P{processes}.log"
        with log.open("w") as f:
            command = [sys.executable, "-m", "lightning_fedshard.bench.quality", "--worker", str(plan)]
            code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        if code != 0:
            raise RuntimeError(f"training on {processes} processes failed (exit {code}); see {log}")
    return [_load(runs_dir / f"{s.name}.json") for s in specs]


def _load(path: Path) -> QualityRun:
    raw = json.loads(path.read_text())
    return QualityRun(RunSpec(**raw["spec"]), raw["tokens_per_step"], raw["curve"], raw["seconds"])


# ---- analysis ---------------------------------------------------------------------------------------------


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Linear interpolation through ``points`` (sorted by x); NaN outside them."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[0][1] if points and x == points[0][0] else math.nan


def at_step(run: QualityRun, step: float) -> float:
    """Validation loss after ``step`` optimizer steps (interpolated between validations)."""
    return _interpolate([(p["step"], p["val_loss"]) for p in run.curve], step)


def at_tokens(run: QualityRun, tokens: float) -> float:
    """Validation loss once the run has consumed ``tokens`` training tokens (all ranks)."""
    return at_step(run, tokens / run.tokens_per_step)


def step_seconds(layout: str, groups: int, sync_every: int) -> float:
    """Seconds of one Llama 3.1 8B optimizer step at the paper's 512-GPU scale on Leonardo (the cost model)."""
    from lightning_fedshard.bench.costmodel import LEONARDO, paper_workload, step_time
    from lightning_fedshard.strategies.dims import FedShardDims

    dims = {
        "hsdp": FedShardDims(1, 128, 4),
        "fsdp2": FedShardDims(1, 1, 512),
        "fl_hsdp": FedShardDims(groups, 128 // groups, 4),
        "fl_fsdp": FedShardDims(groups, 1, 512 // groups),
    }[layout]
    return step_time(paper_workload(dims, sync_every=sync_every), LEONARDO).total


def equal_time_steps(steps: int, fl_seconds: float, base_seconds: float) -> tuple[float, float]:
    """Steps (FL, baseline) each completes in the same wall time: the time the faster of the two needs for
    ``steps`` steps, where the slower is behind in proportion (both points lie on the measured curves)."""
    budget = steps * min(fl_seconds, base_seconds)
    return budget / fl_seconds, budget / base_seconds


def break_even_speedup(fl: QualityRun, base: QualityRun, steps: int) -> float:
    """The speed-up over the baseline at which FL's loss after ``steps`` steps is reached in the same wall time:
    ``steps / x`` where the baseline's curve first comes down to that loss after ``x`` steps; 1 when the
    baseline never gets there within ``steps`` (FL ahead already at equal steps), NaN when FL's loss lies above
    the baseline's whole measured curve."""
    target = at_step(fl, steps)
    points = [(p["step"], p["val_loss"]) for p in base.curve if p["step"] <= steps]
    if at_step(base, steps) >= target:
        return 1.0
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y0 >= target >= y1:
            return steps / (x0 + (x1 - x0) * (y0 - target) / (y0 - y1))
    return math.nan


def _stats(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def _ppl(mean_sd: tuple[float, float]) -> str:
    mean, sd = mean_sd
    return "—" if math.isnan(mean) else f"{mean:.2f} ± {sd:.2f}"


def _paired(
    runs: list[QualityRun], base: dict[tuple[int, int], QualityRun], value: Callable[[QualityRun, QualityRun], float]
) -> tuple[float, float]:
    return _stats([value(r, base[(r.spec.world, r.spec.seed)]) for r in runs])


def format_tables(runs: list[QualityRun], steps: int, sync_every: int) -> str:
    """Markdown: perplexity at equal steps (= equal tokens at one W), the paired ratio to hsdp, the ratio at
    equal modelled wall time for both FL layouts, and perplexity at equal tokens across world sizes."""
    configs: dict[str, list[QualityRun]] = defaultdict(list)
    for r in sorted(runs, key=lambda r: (r.spec.world, r.spec.groups, r.spec.outer or "", r.spec.seed)):
        configs[r.spec.config].append(r)
    base = {
        (r.spec.world, r.spec.seed): r for r in runs if r.spec.groups == 1 and r.spec.processes in (4, r.spec.world)
    }
    speed = {}
    for groups in {r.spec.groups for r in runs if r.spec.groups > 1}:
        for layout, counterpart in PAIRS.items():
            fl, counter = step_seconds(layout, groups, sync_every), step_seconds(counterpart, 1, sync_every)
            speed[(layout, groups)] = (fl, counter)

    seeds = sorted({r.spec.seed for r in runs})
    lines = [
        f"Validation perplexity, mean ± sd over seeds {seeds}; ratios are FL/hsdp per seed (same seed: same",
        f"initial weights and the same samples each step), then mean ± sd. {steps} optimizer steps of W·b samples.",
        "Equal wall time: the faster layout's time for all steps, where the slower one is behind (cost",
        f"model, Llama 3.1 8B on 512 A100s, sync every {sync_every}; speed-up = counterpart step / FL step).",
        "",
        "Break-even: the speed-up over hsdp at which FL's loss after all steps comes in the same wall time.",
        "",
        "| W | layout | outer | ppl @ equal steps = equal tokens | ×hsdp | fl_hsdp speed-up | ×hsdp @ equal time"
        " | fl_fsdp speed-up | ×fsdp2 @ equal time | break-even speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config, group in configs.items():
        spec = group[0].spec
        final = _stats([math.exp(at_step(r, steps)) for r in group])
        cells = [str(spec.world), f"F={spec.groups}" + ("" if spec.processes in (4, spec.world) else f" ({spec.processes} proc)"),
                 OUTERS.get(spec.outer or "", "—"), _ppl(final)]  # fmt: skip
        if spec.groups == 1:
            cells += ["1", "", "", "", "", ""]
        else:
            cells.append(_ppl(_paired(group, base, lambda r, b: math.exp(at_step(r, steps) - at_step(b, steps)))))
            for layout in PAIRS:
                fl_s, counter_s = speed[(layout, spec.groups)]
                fl_steps, base_steps = equal_time_steps(steps, fl_s, counter_s)
                ratio = _paired(group, base, lambda r, b: math.exp(at_step(r, fl_steps) - at_step(b, base_steps)))
                cells += [f"{counter_s / fl_s:.2f}×", _ppl(ratio)]
            cells.append(_ppl(_paired(group, base, lambda r, b: break_even_speedup(r, b, steps))) + "×")
        lines.append("| " + " | ".join(cells) + " |")

    worlds = sorted({r.spec.world for r in runs})
    budgets = sorted({r.tokens_per_step * steps for r in runs})
    lines += [
        "",
        "Equal tokens across world sizes (ppl after T training tokens; — where a run ends before T or T falls",
        "before its first validation):",
        "",
        "| W | layout | outer | " + " | ".join(f"T = {t / 1e6:.2f} M" for t in budgets) + " |",
        "|---|---|---|" + "---|" * len(budgets),
    ]
    for world in worlds:
        for config, group in configs.items():
            spec = group[0].spec
            if spec.world != world:
                continue
            cells = [str(world), f"F={spec.groups}", OUTERS.get(spec.outer or "", "—")]
            cells += [_ppl(_stats([math.exp(at_tokens(r, t)) for r in group])) for t in budgets]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[QualityRun], path: Path) -> None:
    """Validation perplexity (mean of seeds) against optimizer steps, one panel per world size, and against
    training tokens for every world size in a last panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    worlds = sorted({r.spec.world for r in runs})
    fig, axes = plt.subplots(1, len(worlds) + 1, figsize=(3.3 * (len(worlds) + 1), 3.6), sharey=True)
    configs: dict[str, list[QualityRun]] = defaultdict(list)
    for r in runs:
        configs[r.spec.config].append(r)
    styles = {None: "-", "avg": "--", "nesterov": ":"}
    colors = {}
    top = 0.0
    for config, group in sorted(configs.items(), key=lambda kv: (kv[1][0].spec.groups, kv[1][0].spec.outer or "")):
        spec = group[0].spec
        steps = [p["step"] for p in group[0].curve]
        ppl = [math.exp(statistics.fmean(at_step(r, s) for r in group)) for s in steps]
        top = max(top, ppl[1] if len(ppl) > 1 else ppl[0])  # the first validation, in warm-up, is left off the scale
        label = "hsdp" if spec.groups == 1 else f"F={spec.groups} {OUTERS[spec.outer]}"
        line = axes[worlds.index(spec.world)].plot(
            steps, ppl, styles[spec.outer], marker=".", label=label, color=colors.get(label)
        )
        colors[label] = line[0].get_color()
        if spec.groups <= 2:  # the tokens panel: hsdp and 2 groups, coloured by world size
            tokens = [s * group[0].tokens_per_step for s in steps]
            axes[-1].plot(tokens, ppl, styles[spec.outer], color=f"C{worlds.index(spec.world)}", lw=1)
    for column, world in enumerate(worlds):
        axes[column].set(title=f"W = {world}", xlabel="optimizer steps")
    axes[-1].set(title="all W (colour); hsdp —, F=2 FedAvg --, DiLoCo ··", xlabel="training tokens", xscale="log")
    axes[-1].title.set_fontsize(7)
    axes[-1].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(top=top * 1.05)
    axes[0].set_ylabel("validation perplexity")
    for ax in axes[:-1]:
        ax.legend(fontsize=6)
    for column, world in enumerate(worlds):
        axes[-1].plot([], [], color=f"C{column}", label=f"W={world}")
    axes[-1].legend(fontsize=7)
    fig.suptitle("tiny Llama 3.1: hsdp vs FL groups, identical per-rank hyperparameters (mean of seeds)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench quality", description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16, 64])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--outers", nargs="+", choices=list(OUTERS), default=list(OUTERS))
    parser.add_argument("--processes", type=int, default=4, help="real processes of the worlds above --wide")
    parser.add_argument("--wide", type=int, default=8, help="largest world run as one process per rank")
    parser.add_argument("--steps", type=int, default=32, help="optimizer steps of every run")
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--val-every", type=int, default=4, help="optimizer steps; a multiple of --sync-every")
    parser.add_argument("--batch", type=int, default=2, help="micro-batch per rank (sequences)")
    parser.add_argument("--val-samples", type=int, default=128, help="the same validation sequences for every run")
    parser.add_argument("--skip", nargs="+", default=[], help="configurations left out, e.g. W64-F2-nesterov")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-quality"))
    parser.add_argument("--analyse", action="store_true", help="tables and plot from the runs under --out only")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(args.worker)
        return
    results = args.out / "results.json"
    if args.analyse:  # every run finished so far, also of a grid still training or cut short
        settings = json.loads((args.out / "settings.json").read_text())
        runs = [_load(path) for path in sorted((args.out / "runs").glob("*.json"))]
    else:
        if args.val_every % args.sync_every or args.steps % args.val_every:
            parser.error("--val-every must be a multiple of --sync-every and divide --steps")
        settings = {k: getattr(args, k) for k in ("steps", "sync_every", "val_every", "batch", "val_samples")}
        specs = [
            s
            for s in grid(args.worlds, args.seeds, args.outers, args.processes, args.wide)
            if s.config not in args.skip
        ]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "settings.json").write_text(json.dumps(settings))
        runs = train(specs, settings, args.out, args.timeout)
    results.write_text(json.dumps({"settings": settings, "runs": [asdict(r) for r in runs]}, indent=1))
    table = format_tables(runs, settings["steps"], settings["sync_every"])
    (args.out / "quality.md").write_text(table + "\n")
    plot(runs, args.out / "quality.png")
    print(table)
    print(f"\nplot: {args.out / 'quality.png'}\nresults: {results}")


if __name__ == "__main__":
    main()
