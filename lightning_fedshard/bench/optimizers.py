"""AdamW, 8-bit AdamW and Muon side by side, and the Llama 3.1 8B recipes' shard plan and optimizer state per GPU.

``fedshard bench optimizers`` trains the tiny Llama with each optimizer under the tiny ``fsdp2`` and ``fl_hsdp``
recipes (4 processes, the same steps) and prints validation loss, tokens/s and optimizer-state bytes on rank 0
(which holds the largest shard), with ratios to AdamW under the same layout. ``--plan`` prints, without training,
the block-aligned shard plan of every 8B recipe on the meta device (its padding next to FSDP2's own) and the
optimizer-state bytes per GPU each optimizer needs there.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from lightning_fedshard.bench.recipes import TINY, metrics_path, read_metrics, run_recipe
from lightning_fedshard.models import Llama, LlamaConfig
from lightning_fedshard.optim import BlockShardPlan, muon_param_groups
from lightning_fedshard.recipes import Recipe, list_recipes

__all__ = ["OptimizerRun", "main", "state_bytes_per_gpu"]

OPTIMIZERS = ("adamw", "adamw8bit", "muon")
LAYOUTS = ("fsdp2", "fl_hsdp")


@dataclass
class OptimizerRun:
    layout: str
    optimizer: str
    lr: float
    val_loss: float
    tokens_per_s: float
    state_bytes_rank0: float


def train_all(
    out: Path, steps: int, layouts: list[str], optimizers: list[str], lrs: dict[str, float]
) -> list[OptimizerRun]:
    """One run per layout and optimizer; ``lrs`` overrides the recipe's learning rate per optimizer."""
    runs = []
    for layout in layouts:
        recipe = TINY / f"{layout}.yaml"
        recipe_lr = float(yaml.safe_load(recipe.read_text())["model"]["lr"])
        for optimizer in optimizers:
            lr = lrs.get(optimizer, recipe_lr)
            name = f"{layout}-{optimizer}-lr{lr:g}"
            print(f"running {name} ...", flush=True)
            overrides = [
                f"--model.optimizer={optimizer}",
                f"--model.lr={lr}",
                f"--trainer.max_steps={steps}",
                "--trainer.callbacks+=lightning_fedshard.training.OptimizerStateMonitor",
            ]
            result = run_recipe(recipe, out, overrides, name=name)
            rows = read_metrics(metrics_path(out, name)).values()
            state = max(r["optimizer/state_bytes"] for r in rows if "optimizer/state_bytes" in r)
            val_loss = result.val_curve[-1]["val_loss"]
            runs.append(OptimizerRun(layout, optimizer, lr, val_loss, result.tokens_per_s, state))
    return runs


def format_runs(runs: list[OptimizerRun]) -> str:
    header = (
        f"{'layout':<8} {'optimizer':<10} {'lr':>7} {'val loss':>8} {'tokens/s':>9} {'state B/rank':>13}"
        "   ratios to AdamW"
    )
    lines = [header, "-" * (len(header) + 30)]
    for r in runs:
        base = next(b for b in runs if b.layout == r.layout and b.optimizer == "adamw")
        lines.append(
            f"{r.layout:<8} {r.optimizer:<10} {r.lr:>7.1e} {r.val_loss:>8.4f} {r.tokens_per_s:>9.0f} {r.state_bytes_rank0:>13,.0f}"
            f"   loss ×{r.val_loss / base.val_loss:.3f}  tokens/s ×{r.tokens_per_s / base.tokens_per_s:.2f}"
            f"  state ×{r.state_bytes_rank0 / base.state_bytes_rank0:.3f}"
        )
    return "\n".join(lines)


def state_bytes_per_gpu(model: torch.nn.Module, plan: BlockShardPlan, quant_block: int = 128) -> dict[str, int]:
    """Optimizer-state bytes on the GPU holding the largest shards (rank 0 of a shard group) under FSDP2's layout:
    AdamW 8 B per element (fp32 ``m``, ``v``); AdamW8bit 2 B per element plus two fp32 scales per block for tensors
    of at least 4,096 elements (as :class:`~lightning_fedshard.optim.AdamW8bit`'s default), fp32 for the rest; Muon
    4 B per element of a hidden matrix (its momentum) and AdamW's 8 B for embeddings, norms and the head."""
    matrices = {id(p) for p in muon_param_groups(model)[0]["params"]}
    totals = {"adamw": 0, "adamw8bit": 0, "muon": 0}
    for (name, p), pp in zip(model.named_parameters(), plan.params):
        assert pp.name == name
        local = math.ceil(pp.shape[pp.dim] / plan.world) * pp.row  # FSDP2's first (largest) shard
        totals["adamw"] += 8 * local
        quantised = pp.numel >= 4096
        totals["adamw8bit"] += 2 * local + 8 * math.ceil(local / quant_block) if quantised else 8 * local
        totals["muon"] += (4 if id(p) in matrices else 8) * local
    return totals


def print_plans(recipes: list[Recipe], blocks: list[int]) -> dict:
    report = {}
    for recipe in recipes:
        config = yaml.safe_load(recipe.path.read_text())
        args = config["trainer"]["strategy"]["init_args"]
        shards = args["shard_size"]
        with torch.device("meta"):
            model = Llama(LlamaConfig.from_name(config["model"]["preset"]))
        print(f"\n== {recipe.name} ({args.get('num_groups')} groups × {args.get('replicate_size', 1)} replicas × {shards}"
              " shards) ==")
        entry = {}
        for block in blocks:
            plan = BlockShardPlan.for_module(model, shards, block)
            print(plan.report())
            entry[block] = plan.totals()
        state = state_bytes_per_gpu(model, BlockShardPlan.for_module(model, shards, 128))
        print("optimizer state per GPU: " + ", ".join(
            f"{name} {nbytes / 2**30:.2f} GiB (×{nbytes / state['adamw']:.3f})" for name, nbytes in state.items()
        ))
        report[recipe.name] = {"plans": entry, "state_bytes_per_gpu": state}
    return report


def _optimizer_lr(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    if name not in OPTIMIZERS:
        raise argparse.ArgumentTypeError(f"{text!r}: the optimizer must be one of {', '.join(OPTIMIZERS)}")
    try:
        lr = float(value)
    except ValueError:
        lr = math.nan
    if not 0 < lr < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: the learning rate must be a positive number")
    return name, lr


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench optimizers", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="only the 8B recipes' shard plans and state bytes")
    parser.add_argument("--steps", type=int, default=32, help="optimizer steps per tiny run (validated every 16)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    parser.add_argument("--blocks", nargs="+", type=int, default=[256, 128], help="block sizes to plan for")
    parser.add_argument(
        "--lr",
        nargs="+",
        default=[],
        metavar="OPTIMIZER=LR",
        type=_optimizer_lr,
        help="a learning rate per optimizer in place of the recipe's (e.g. muon=2e-2)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench-optimizers"))
    args = parser.parse_args(argv)
    if "adamw" not in args.optimizers:
        parser.error("--optimizers must include adamw, the baseline of the ratios")
    args.out.mkdir(parents=True, exist_ok=True)
    recipes = [r for r in list_recipes() if r.name.startswith("llama3.1-8b/")]
    plans = print_plans(recipes, args.blocks)
    results: dict = {"plans": plans}
    if not args.plan:
        runs = train_all(args.out, args.steps, args.layouts, args.optimizers, dict(args.lr))
        print("\n" + format_runs(runs))
        results["runs"] = [asdict(r) for r in runs]
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nresults: {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
