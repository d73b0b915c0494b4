"""The LightningCLI of ``fedshard fit/validate/test``, apart from :mod:`lightning_fedshard.cli` so that
``fedshard verify`` and ``fedshard bench`` never import Lightning's CLI (and jsonargparse with it)."""

from __future__ import annotations

import sys

from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

import lightning_fedshard  # noqa: F401  (registers the strategy names)
from lightning_fedshard.data import TextDataModule
from lightning_fedshard.recipes import resolve_config_arguments
from lightning_fedshard.training.pretraining import LlamaPretraining

__all__ = ["FedShardCLI"]


class FedShardCLI(LightningCLI):
    """LightningCLI over :class:`LlamaPretraining` and :class:`TextDataModule`.

    The data module's ``seq_len`` is linked to the model's, and the tokenizer's vocabulary is checked against
    the model's embedding before any process starts. Lightning's progress bar (drawn by rank 0) is on by default
    when standard output is a terminal and off otherwise (CI, batch jobs, output piped to a file), where its
    carriage returns would only fill the log; ``--trainer.enable_progress_bar`` decides either way.

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
        parser.set_defaults({"trainer.enable_progress_bar": sys.stdout.isatty()})

    def _check_vocab(self) -> None:
        self.model.check_vocab(self.datamodule.vocab_size)

    before_fit = before_validate = before_test = _check_vocab
