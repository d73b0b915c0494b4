"""``python -m lightning_fedshard.bench NAME [ARGS]`` runs the benchmark ``NAME``."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "recipes": "lightning_fedshard.bench.recipes",
    "compression": "lightning_fedshard.bench.compression",
    "dynamiq-step": "lightning_fedshard.bench.dynamiq_step",
    "verify-memory": "lightning_fedshard.bench.verify_memory",
    "syncs": "lightning_fedshard.bench.syncs",
    "operators": "lightning_fedshard.bench.operators",
    "costmodel": "lightning_fedshard.bench.costmodel",
    "multitier": "lightning_fedshard.bench.multitier",
    "gpu-check": "lightning_fedshard.bench.gpu_check",
    "optimizers": "lightning_fedshard.bench.optimizers",
    "faults": "lightning_fedshard.bench.faults",
    "ft-memory": "lightning_fedshard.bench.ft_memory",
    "deadlines": "lightning_fedshard.bench.deadlines",
    "budget": "lightning_fedshard.bench.budget",
    "convpass": "lightning_fedshard.bench.convpass",
    "abcrown": "lightning_fedshard.bench.abcrown",
    "fuzz": "lightning_fedshard.bench.fuzz",
    "planted": "lightning_fedshard.bench.planted",
    "vit": "lightning_fedshard.bench.vit",
    "counting": "lightning_fedshard.bench.counting",
    "quality": "lightning_fedshard.bench.quality",
    "vnncomp-scripts": "lightning_fedshard.bench.vnncomp_scripts",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        sys.exit(f"usage: fedshard bench {{{','.join(BENCHMARKS)}}} [ARGS]")
    status = importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])
    if isinstance(status, int):  # gpu-check answers with its exit status
        sys.exit(status)


if __name__ == "__main__":
    main()
