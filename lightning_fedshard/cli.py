"""The ``fedshard`` command: LightningCLI for Llama 3.1 pre-training, plus ``demo`` and ``bench``.

``fedshard fit --config tiny/fl_hsdp`` (a recipe name or a YAML path) trains; ``validate``, ``test`` and ``--print_config``
work as in any LightningCLI; ``fedshard verify`` runs neural-network verification; ``fedshard export`` writes a
checkpoint as a Hugging Face model. Strategies are set by registered name (``--trainer.strategy=fl_hsdp``) or
with all their arguments as ``class_path``/``init_args`` in YAML.
"""

from __future__ import annotations

import sys

__all__ = ["FedShardCLI", "main"]  # noqa: F822 (FedShardCLI: module __getattr__)

EXTRA_COMMANDS = """Other commands:
  fedshard recipes         the shipped recipes, by name (`--config NAME`), one line each
  fedshard demo [ARGS]     tiny FL+HSDP recipe next to the tiny HSDP baseline (see `fedshard demo --help`)
  fedshard launch [TORCHRUN OPTIONS] fit ...
                           torchrun whose workers and restarts fork a warm interpreter (`fedshard launch -h`)
  fedshard bench NAME      a benchmark (`fedshard bench --help`)
  fedshard verify ...      verify an ONNX network against a VNN-LIB property (`fedshard verify --help`)
  fedshard export CKPT OUT a checkpoint as a Hugging Face LlamaForCausalLM folder (`fedshard export --help`)
"""


def __getattr__(name: str) -> object:
    # FedShardCLI loads Lightning: only on first use, so that `fedshard verify` starts with torch and onnx alone.
    if name == "FedShardCLI":
        from lightning_fedshard.training.cli import FedShardCLI

        return FedShardCLI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> None:
    """``argv`` defaults to the command line (``sys.argv[1:]``)."""
    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else ""
    if command == "recipes":
        from lightning_fedshard.recipes import format_listing

        print(format_listing())
    elif command == "demo":
        from lightning_fedshard.bench.recipes import demo

        demo(args[1:])
    elif command == "launch":
        from lightning_fedshard.training.launch import main as launch_main

        launch_main(args[1:])
    elif command == "verify":
        from lightning_fedshard.verify.cli import main as verify_main

        sys.exit(verify_main(args[1:], startup_counts=argv is None))
    elif command == "export":
        from lightning_fedshard.models.hf_export import main as export_main

        export_main(args[1:])
    elif command == "bench":
        from lightning_fedshard.bench.__main__ import main as bench_main

        bench_main(args[1:])
    else:
        if command in ("-h", "--help"):
            print(EXTRA_COMMANDS)
        from lightning_fedshard.training.cli import FedShardCLI

        FedShardCLI(args=argv)  # None: LightningCLI reads sys.argv itself


if __name__ == "__main__":
    main()
