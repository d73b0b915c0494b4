"""Recipes side by side: tokens/s, validation perplexity and bytes per tier per step, plus a plot.

``fedshard demo`` runs the tiny HSDP and FL+HSDP recipes; ``fedshard bench recipes`` all four tiny
ones. Each recipe runs as ``fedshard fit --config RECIPE`` in its own process tree with a CSV logger,
and everything reported is read back from the metrics it logged: throughput from
:class:`~lightning_fedshard.training.TokenThroughputMonitor`, bytes from the strategies' ledger
(``comm/*_bytes``), ``val_loss``/``val_ppl`` from the module. Ratios are to the first recipe.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import subprocess
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from lightning_fedshard.recipes import RECIPES, recipe_file
from lightning_fedshard.strategies.ledger import TIERS

__all__ = [
    "RecipeResult",
    "demo",
    "demo_reading",
    "fit_arguments",
    "format_table",
    "main",
    "metrics_path",
    "read_metrics",
    "run_recipe",
    "summarize",
]

TINY = RECIPES / "tiny"


@dataclass
class RecipeResult:
    name: str
    world_size: int
    tokens_per_s: float
    """All ranks together, training steps only (validation excluded), first step left out."""
    val_ppl: float
    bytes_per_step: dict[str, float]
    """Mean bytes one rank sends per optimizer step, per tier."""
    val_curve: list[dict[str, float]]
    """One point per validation: ``step``, ``train_seconds``, ``tokens`` (all ranks) and ``val_loss``."""


def read_metrics(path: Path) -> dict[int, dict[str, float]]:
    """The CSV logger's rows merged by step (the module, the strategy and the callback log separately)."""
    rows: dict[int, dict[str, float]] = defaultdict(dict)
    with path.open() as f:
        for row in csv.DictReader(f):
            rows[int(row["step"])].update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return dict(sorted(rows.items()))


def summarize(name: str, rows: dict[int, dict[str, float]]) -> RecipeResult:
    """One run's result from its merged metric rows (``log_every_n_steps=1``, as :func:`run_recipe` sets)."""
    timed = [r for r in rows.values() if "train/time" in r and "train/lengths" in r]
    rated = [r for r in timed if "train/device/items_per_sec" in r]
    if len(timed) < 2 or not rated:
        raise RuntimeError(f"{name}: too few throughput rows logged; run more steps than the monitor's window_size.")
    # the monitor logs the global rate as world size × the rank's rate (and no global rate on one rank)
    rates = rated[-1]
    world = round(
        rates.get("train/items_per_sec", rates["train/device/items_per_sec"]) / rates["train/device/items_per_sec"]
    )
    first, last = timed[0], timed[-1]
    per_rank = (last["train/lengths"] - first["train/lengths"]) / (last["train/time"] - first["train/time"])
    steps = [r for r in rows.values() if f"comm/{TIERS[0]}_bytes" in r]
    # strategies without a ledger (ddp_dynamiq) log no comm/* bytes: unknown, not zero
    bytes_per_step = {
        tier: sum(r[f"comm/{tier}_bytes"] for r in steps) / len(steps) if steps else math.nan for tier in TIERS
    }
    curve = []
    for step, r in rows.items():
        if "val_loss" in r:
            # the training clock as of the last step logged before this validation
            clock = next((rows[s] for s in range(step, -1, -1) if "train/time" in rows.get(s, {})), {})
            curve.append(
                {
                    "step": step,
                    "train_seconds": clock.get("train/time", 0.0),
                    "tokens": clock.get("train/lengths", 0.0) * world,
                    "val_loss": r["val_loss"],
                }
            )
    if not curve:
        raise RuntimeError(f"{name}: no validation was logged; check val_check_interval against max_steps.")
    return RecipeResult(name, world, per_rank * world, math.exp(curve[-1]["val_loss"]), bytes_per_step, curve)


def metrics_path(out_dir: Path, name: str) -> Path:
    """Where :func:`run_recipe` leaves the CSV metrics of the run called ``name``."""
    return out_dir / name / "csv" / "version_0" / "metrics.csv"


def fit_arguments(config: Path, out_dir: Path, overrides: list[str], name: str) -> list[str]:
    """``fedshard fit`` arguments (after ``python -m lightning_fedshard.cli``) for one comparable run of
    ``config``: a CSV logger at :func:`metrics_path`, every step logged, no checkpoints."""
    if not config.is_file():
        raise FileNotFoundError(f"No recipe at {str(config)!r}: pass a recipe name (`fedshard recipes`) or a path.")
    return [
        "fit", "--config", str(config),
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={out_dir / name}",
        "--trainer.logger.init_args.name=csv",
        "--trainer.logger.init_args.version=0",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_checkpointing=false",  # a comparison keeps no checkpoints
        *overrides,
    ]  # fmt: skip


def run_recipe(config: Path, out_dir: Path, overrides: list[str], name: str | None = None) -> RecipeResult:
    """``fedshard fit --config config`` with a CSV logger under ``out_dir``; fails with the run's log tail.
    ``name`` (default: the recipe's file name) keeps several runs of one recipe apart."""
    name = name or config.stem
    command = [sys.executable, "-m", "lightning_fedshard.cli", *fit_arguments(config, out_dir, overrides, name)]
    log = out_dir / f"{name}.log"
    with log.open("w") as f:
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{config} failed (exit {code}); last lines of {log}:\n{log.read_text()[-4000:]}")
    return summarize(name, read_metrics(metrics_path(out_dir, name)))


def format_table(results: list[RecipeResult]) -> str:
    header = f"{'recipe':<9} {'tokens/s':>9} {'val ppl':>8} " + " ".join(f"{t + ' B/step':>16}" for t in TIERS)
    lines = [
        "tokens/s: all ranks, training steps only; B/step: bytes one rank sends per optimizer step",
        header,
        "-" * len(header),
    ]
    for r in results:
        lines.append(
            f"{r.name:<9} {r.tokens_per_s:>9.0f} {r.val_ppl:>8.3f} "
            + " ".join(f"{r.bytes_per_step[t]:>16,.0f}" for t in TIERS)
        )
    base = results[0]
    lines += ["", f"ratios to {base.name} (same invocation):"]
    for r in results:
        total, base_total = sum(r.bytes_per_step.values()), sum(base.bytes_per_step.values())
        lines.append(
            f"  {r.name:<9} tokens/s ×{r.tokens_per_s / base.tokens_per_s:.2f}"
            f"   val ppl ×{r.val_ppl / base.val_ppl:.3f}   bytes/step, all tiers ×{total / base_total:.3f}"
        )
    return "\n".join(lines)


def plot(results: list[RecipeResult], path: Path) -> None:
    """Validation loss against training wall-clock time and against tokens, one line per recipe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for r in results:
        losses = [p["val_loss"] for p in r.val_curve]
        by_time.plot([p["train_seconds"] for p in r.val_curve], losses, marker="o", label=r.name)
        by_tokens.plot([p["tokens"] for p in r.val_curve], losses, marker="o", label=r.name)
    by_time.set(xlabel="training wall-clock time (s)", ylabel="validation loss (nats/token)")
    by_tokens.set(xlabel="tokens processed (all ranks)")
    for ax in (by_time, by_tokens):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parser(prog: str, configs: list[Path], out: Path) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        type=recipe_file,
        default=configs,
        help="recipe names or paths; the first is the baseline",
    )
    parser.add_argument("--out", type=Path, default=out, help="logs, metrics, results.json and the plot go here")
    parser.add_argument(
        "--override", action="append", default=[], help="passed to every `fedshard fit`, e.g. --trainer.max_steps=32"
    )
    return parser


def compare(args: argparse.Namespace) -> list[RecipeResult]:
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for config in args.configs:
        print(f"running {config} ...", flush=True)
        results.append(run_recipe(config, args.out, args.override))
    print(format_table(results))
    png = args.out / "val_loss.png"
    plot(results, png)
    (args.out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    print(f"\nplot: {png}\nmetrics: {args.out / 'results.json'}")
    return results


def demo_reading(results: list[RecipeResult], groups: list[int | None]) -> str:
    """What the demo's val ppl ratios measure, printed under its table: equal tokens and steps, one seed, the
    demo's few groups; the paper's quality claim is another question, which ``fedshard bench quality`` answers."""
    base = results[0]
    lines = ["", "reading:"]
    for result, num_groups in zip(results[1:], groups[1:]):
        last, base_last = result.val_curve[-1], base.val_curve[-1]
        matched = last["tokens"] == base_last["tokens"] and last["step"] == base_last["step"]
        lines.append(
            f"  {result.name} val ppl ×{result.val_ppl / base.val_ppl:.3f}: one seed, "
            + (f"{num_groups} federation groups, " if num_groups else "")
            + ("matched" if matched else "UNMATCHED")
            + f" tokens and optimizer steps ({last['tokens']:,.0f} tokens in {last['step'] + 1:.0f} steps"
            + ("" if matched else f" against {base_last['tokens']:,.0f} in {base_last['step'] + 1:.0f}")
            + f"), {result.world_size} processes."
        )
    lines += [
        "  Every layout consumes world × micro-batch samples per step, so at equal steps the groups only trade one",
        "  step on the whole batch for steps on their share of it, averaged every few steps: the ratio is what",
        "  that costs at this world size. The paper's quality claim is about large worlds, where the baseline's",
        "  global batch outgrows what helps; `fedshard bench quality` measures it (docs/benchmarks.md).",
    ]
    return "\n".join(lines)


def _num_groups(config: Path) -> int | None:
    strategy = yaml.safe_load(config.read_text()).get("trainer", {}).get("strategy", {})
    return strategy.get("init_args", {}).get("num_groups") if isinstance(strategy, dict) else None


def demo(argv: list[str] | None = None) -> None:
    """The README's main command: the tiny FL+HSDP recipe next to the tiny HSDP baseline."""
    configs = [TINY / "hsdp.yaml", TINY / "fl_hsdp.yaml"]
    args = _parser("fedshard demo", configs, Path("runs/demo")).parse_args(argv)
    results = compare(args)
    print(demo_reading(results, [_num_groups(config) for config in args.configs]))


def main(argv: list[str] | None = None) -> None:
    configs = [TINY / f"{name}.yaml" for name in ("hsdp", "fsdp2", "fl_fsdp", "fl_hsdp")]
    compare(_parser("fedshard bench recipes", configs, Path("runs/bench-recipes")).parse_args(argv))


if __name__ == "__main__":
    main()
