"""The ``fedshard`` command: LightningCLI for Llama 3.1 pre-training, plus ``demo`` and ``bench``.

``fedshard fit --config tiny/fl_hsdp`` (a recipe name or a YAML path) trains; ``validate``, ``test`` and ``--print_config``
work as in any LightningCLI; ``fedshard verify`` runs neural-network verification. Strategies are set by registered name (``--trainer.strategy=fl_hsdp``) or
with all their arguments as ``class_path``/``init_args`` in YAML.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

import lightning_fedshard  # noqa: F401  (registers the strategy names)
from lightning_fedshard.data import TextDataModule
from lightning_fedshard.recipes import resolve_config_arguments
from lightning_fedshard.training import LlamaPretraining

__all__ = ["FedShardCLI", "main"]

EXTRA_COMMANDS = """Other commands:
  fedshard recipes         the shipped recipes, by name (`--config NAME`), one line each
  fedshard demo [ARGS]     tiny FL+HSDP recipe next to the tiny HSDP baseline (see `fedshard demo --help`)
  fedshard bench NAME      a benchmark (`fedshard bench --help`)
  fedshard verify ...      verify an ONNX network against a VNN-LIB property (`fedshard verify --help`)
"""


class FedShardCLI(LightningCLI):
    """LightningCLI over :class:`LlamaPretraining` and :class:`TextDataModule`.

    The data module's ``seq_len`` is linked to the model's, and the tokenizer's vocabulary is checked against
    the model's embedding before any process starts.

    Example::

        FedShardCLI(args=["fit", "--config", "tiny/fl_hsdp", "--trainer.max_steps=10"])
    """

    def __init__(self, args: list[str] | None = None, **kwargs) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(LlamaPretraining, TextDataModule, args=args, **kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Recipe names after ``--config`` become their files' paths before jsonargparse reads them (it would
        take an unknown name for inline YAML)."""
        if args is None or isinstance(args, (list, tuple)):
            try:
                resolved = resolve_config_arguments(sys.argv[1:] if args is None else list(args))
            except FileNotFoundError as error:
                parser.error(str(error))
            if args is None:  # what LightningCLI would parse from sys.argv, with the names resolved
                self.config = parser.parse_args(resolved)
                return
            args = resolved
        super().parse_arguments(parser, args)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.seq_len", "model.seq_len")

    def _check_vocab(self) -> None:
        self.model.check_vocab(self.datamodule.vocab_size)

    before_fit = before_validate = before_test = _check_vocab


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
    elif command == "verify":
        from lightning_fedshard.verify.cli import main as verify_main

        sys.exit(verify_main(args[1:], startup_counts=argv is None))
    elif command == "bench":
        from lightning_fedshard.bench.__main__ import main as bench_main

        bench_main(args[1:])
    else:
        if command in ("-h", "--help"):
            print(EXTRA_COMMANDS)
        FedShardCLI(args=argv)  # None: LightningCLI reads sys.argv itself


if __name__ == "__main__":
    main()
