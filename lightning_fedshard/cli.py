"""The ``fedshard`` command: ``fedshard demo`` and ``fedshard bench NAME``."""

from __future__ import annotations

import sys

USAGE = """usage: fedshard {demo,bench} ...

  demo          train one small model with fsdp2, hsdp, fl_fsdp and fl_hsdp on 4 CPU processes
                and print throughput, validation perplexity and bytes per tier per step
  bench NAME    run a benchmark (python -m lightning_fedshard.bench NAME)
"""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "demo":
        from lightning_fedshard.bench import strategies

        strategies.main(rest)
    elif command == "bench":
        from lightning_fedshard.bench.__main__ import main as bench_main

        bench_main(rest)
    else:
        sys.exit(USAGE)
