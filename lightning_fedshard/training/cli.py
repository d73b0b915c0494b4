"""The LightningCLI of ``fedshard fit/validate/test``, apart from :mod:`lightning_fedshard.cli` so that
``fedshard verify`` and ``fedshard bench`` never import Lightning's CLI (and jsonargparse with it)."""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_fedshard  # noqa: F401  (registers the strategy names)
from lightning_fedshard.data import TextDataModule
from lightning_fedshard.training.pretraining import LlamaPretraining

__all__ = ["FedShardCLI"]


class FedShardCLI(LightningCLI):
    """LightningCLI over :class:`LlamaPretraining` and :class:`TextDataModule`.

    The data module's ``seq_len`` is linked to the model's, and the tokenizer's vocabulary is checked against
    the model's embedding before any process starts.

    Example::

        FedShardCLI(args=["fit", "--config", "recipes/tiny/fl_hsdp.yaml", "--trainer.max_steps=10"])
    """

    def __init__(self, args: list[str] | None = None, **kwargs) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(LlamaPretraining, TextDataModule, args=args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.seq_len", "model.seq_len")

    def _check_vocab(self) -> None:
        self.model.check_vocab(self.datamodule.vocab_size)

    before_fit = before_validate = before_test = _check_vocab
