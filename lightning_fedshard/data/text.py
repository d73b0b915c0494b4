"""A LightningDataModule for causal-LM pre-training: text in, packed ``(inputs, targets)`` batches out."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
from torch.utils.data import Dataset, DistributedSampler, TensorDataset

from lightning_fedshard.data.corpus import (
    check_text_files,
    corpus_files,
    load_hub_corpus,
    load_text_corpus,
    stdlib_corpus,
)
from lightning_fedshard.data.packing import PackedStream, pack_documents
from lightning_fedshard.data.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    # imported where data is loaded: the package (the verifier, the models) imports without `datasets`/`torchdata`
    import datasets
    from torchdata.stateful_dataloader import StatefulDataLoader

__all__ = ["TextDataModule"]

_HUB_PREFIX = "hf://"


def _stateful_loader(dataset: Dataset, **kwargs: Any) -> StatefulDataLoader:
    # torchdata 0.11 calls torch.set_vital, which recent torch deprecates, in every StatefulDataLoader constructor.
    # Filtered here rather than at import: pytest (and any catch_warnings block) would drop an import-time filter.
    from torchdata.stateful_dataloader import StatefulDataLoader

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning, module="torchdata")
        return StatefulDataLoader(dataset, **kwargs)


class _EncodedTexts:
    """Re-iterable token lists of a streamed dataset's ``"text"`` column (PackedStream iterates once per epoch)."""

    def __init__(self, rows: datasets.IterableDataset, tokenizer: Tokenizer) -> None:
        self.rows = rows
        self.tokenizer = tokenizer

    def __iter__(self) -> Iterator[list[int]]:
        return (self.tokenizer.encode(row["text"]) for row in self.rows)


class TextDataModule(pl.LightningDataModule):
    """Tokenised, packed text for next-token pre-training; batches are ``(inputs, targets)``, both
    ``(batch_size, seq_len)`` LongTensors, with ``targets`` = ``inputs`` shifted by one token (see
    :mod:`lightning_fedshard.data.packing`).

    Every rank reads different samples: map-style data goes through a :class:`DistributedSampler` built
    from the strategy's ``distributed_sampler_kwargs`` (the federated strategies spread it over all ranks
    of all groups), streamed data is split with ``datasets.distributed.split_dataset_by_node``. The loaders
    are ``StatefulDataLoader``\\s, so Lightning checkpoints their position and a resumed run continues
    with the next batch. Ranks may get different numbers of batches from a stream (documents differ in
    length), so bound streamed training with ``max_steps`` below one pass rather than by epochs.

    Arguments:
        source: ``None`` for the embedded standard-library corpus; a local file, directory or glob of
            ``.txt``/``.jsonl``/``.json``/``.parquet`` files; or ``"hf://<dataset name>"`` to stream a
            Hugging Face Hub dataset.
        text_field: column holding the text in JSON, Parquet and Hub datasets.
        hub_config: configuration (subset) name of a Hub dataset.
        tokenizer: ``"bytes"`` or the path of a ``tokenizer.json`` (see :func:`load_tokenizer`).
        seq_len: tokens per training sample.
        batch_size: samples per batch on each rank.
        val_fraction: fraction of the documents of a local source held out for validation (deterministic
            given ``seed``); unused for the standard-library corpus (it holds out ``VALIDATION_MODULES``)
            and for Hub sources (they use ``hub_val_split``).
        hub_val_split: Hub split used for validation; ``None`` for no validation.
        seed: seed of the validation split and of the per-epoch shuffling.
        num_workers: DataLoader worker processes.
        max_val_samples: cap on the number of validation samples (across all ranks; a streamed split reads
            up to ``ceil(max_val_samples / ranks)`` on each); ``None`` for all.

    Example::

        dm = TextDataModule(seq_len=128, batch_size=4)  # standard-library sources, byte tokens
        dm.setup("fit")
        inputs, targets = next(iter(dm.train_dataloader()))  # two (4, 128) LongTensors
    """

    def __init__(
        self,
        source: str | None = None,
        text_field: str = "text",
        hub_config: str | None = None,
        tokenizer: str = "bytes",
        seq_len: int = 256,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        hub_val_split: str | None = "validation",
        seed: int = 42,
        num_workers: int = 0,
        max_val_samples: int | None = None,
    ) -> None:
        super().__init__()
        # Checked here, in the launching process, so a mistake fails before any process group starts.
        for name, value, low in [
            ("seq_len", seq_len, 1),
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
        ]:
            if value < low:
                raise ValueError(f"TextDataModule: `{name}` must be ≥ {low}, got {value}.")
        if not 0 < val_fraction < 1:
            raise ValueError(f"TextDataModule: `val_fraction` must be between 0 and 1 (exclusive), got {val_fraction}.")
        if max_val_samples is not None and max_val_samples < 1:
            raise ValueError(f"TextDataModule: `max_val_samples` must be ≥ 1 or None, got {max_val_samples}.")
        if source == _HUB_PREFIX:
            raise ValueError(f"TextDataModule: `source` {source!r} names no dataset; use 'hf://<dataset name>'.")
        if source is not None and not source.startswith(_HUB_PREFIX):
            # a missing, empty, mixed-format or binary local corpus fails here, not on every rank
            check_text_files(corpus_files(source))
        self.source = source
        self.text_field = text_field
        self.hub_config = hub_config
        self.tokenizer = load_tokenizer(tokenizer)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.hub_val_split = hub_val_split
        self.seed = seed
        self.num_workers = num_workers
        self.max_val_samples = max_val_samples
        self._splits: dict[str, Dataset | datasets.IterableDataset | None] = {}

    @property
    def vocab_size(self) -> int:
        """Size of the tokenizer's vocabulary; the model's embedding must have at least this many rows."""
        return self.tokenizer.vocab_size

    @property
    def _is_hub(self) -> bool:
        return self.source is not None and self.source.startswith(_HUB_PREFIX)

    def setup(self, stage: str | None = None) -> None:
        wanted = ["train", "val"] if stage in (None, "fit") else ["val"] if stage == "validate" else []
        for split in wanted:
            if split not in self._splits:
                self._splits[split] = self._hub_stream(split) if self._is_hub else self._packed(split)

    def _documents(self, split: Literal["train", "val"]) -> datasets.Dataset:
        if self.source is None:
            return stdlib_corpus(split)
        corpus = load_text_corpus(self.source, self.text_field)
        try:
            halves = corpus.train_test_split(test_size=self.val_fraction, seed=self.seed, shuffle=True)
        except ValueError as e:  # too few documents to hold any out
            raise ValueError(
                f"TextDataModule: cannot hold out val_fraction={self.val_fraction} of the {len(corpus)} documents "
                f"of {self.source!r} ({e}); add documents or change `val_fraction`."
            ) from e
        return halves["train" if split == "train" else "test"]

    def _packed(self, split: Literal["train", "val"]) -> TensorDataset:
        documents = self._documents(split)
        encode = self.tokenizer.encode
        # Kept in memory: the packed stream is held in memory anyway, and no cache file is shared between ranks.
        ids = documents.map(
            lambda batch: {"ids": [encode(text) for text in batch["text"]]},
            batched=True,
            remove_columns=documents.column_names,
            keep_in_memory=True,
        )
        inputs, targets = pack_documents(ids.with_format("numpy")["ids"], self.seq_len, self.tokenizer.eos_id)
        if len(inputs) == 0:
            raise ValueError(
                f"TextDataModule: the {split} split of {self.source or 'the standard library'!r} packs into no "
                "samples (it has fewer than 2 tokens); use a larger corpus or another `val_fraction`."
            )
        if split == "val" and self.max_val_samples is not None:
            inputs, targets = inputs[: self.max_val_samples], targets[: self.max_val_samples]
        return TensorDataset(inputs, targets)

    def _hub_stream(self, split: Literal["train", "val"]) -> datasets.IterableDataset | None:
        if split == "val" and self.hub_val_split is None:
            return None
        hub_split = "train" if split == "train" else self.hub_val_split
        return load_hub_corpus(self.source.removeprefix(_HUB_PREFIX), hub_split, self.hub_config, self.text_field)

    def _rank_and_world(self) -> tuple[int, int]:
        """``(rank, replicas)`` this process reads as: the strategy's sampler arguments, else the trainer's."""
        if self.trainer is None:
            return 0, 1
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None)
        if kwargs is None:
            return self.trainer.global_rank, self.trainer.world_size
        return kwargs["rank"], kwargs["num_replicas"]

    def train_dataloader(self) -> StatefulDataLoader:
        return self._loader("train")

    def val_dataloader(self) -> StatefulDataLoader | list:
        return self._loader("val") if self._dataset("val") is not None else []

    def _dataset(self, split: str) -> Dataset | datasets.IterableDataset | None:
        if split not in self._splits:
            raise RuntimeError(f"TextDataModule: call `setup()` before asking for the {split} dataloader.")
        return self._splits[split]

    def _loader(self, split: Literal["train", "val"]) -> StatefulDataLoader:
        rank, world = self._rank_and_world()
        data = self._dataset(split)
        train = split == "train"
        import datasets
        from datasets.distributed import split_dataset_by_node

        if isinstance(data, datasets.IterableDataset):
            limit = None if train or self.max_val_samples is None else -(-self.max_val_samples // world)
            packed = PackedStream(
                _EncodedTexts(split_dataset_by_node(data, rank=rank, world_size=world), self.tokenizer),
                self.seq_len,
                self.tokenizer.eos_id,
                max_samples=limit,
            )
            return _stateful_loader(packed, batch_size=self.batch_size, drop_last=train, num_workers=self.num_workers)
        # Shuffled with seed + epoch (Lightning calls set_epoch); Lightning keeps a DistributedSampler as it is.
        sampler = DistributedSampler(
            data, num_replicas=world, rank=rank, shuffle=train, seed=self.seed, drop_last=train
        )
        if train and len(sampler) < self.batch_size:
            raise ValueError(
                f"TextDataModule: rank {rank} of {world} gets {len(sampler)} training samples, fewer than "
                f"batch_size={self.batch_size}; use a larger corpus or a smaller `batch_size` or `seq_len`."
            )
        # Training drops the last partial batch so every step sees (batch_size, seq_len) batches.
        return _stateful_loader(
            data, batch_size=self.batch_size, sampler=sampler, drop_last=train, num_workers=self.num_workers
        )
