"""Lossless packing of tokenised documents into fixed-length next-token training samples.

The convention, shared by :func:`pack_documents` (in memory) and :class:`PackedStream` (streaming):

* every document is followed by ``eos_id`` and all documents are concatenated into one token stream;
* the stream is cut into windows of ``seq_len + 1`` tokens that overlap by one token (window ``k`` covers
  stream positions ``k * seq_len`` to ``k * seq_len + seq_len``), so every token except the first is a
  prediction target exactly once;
* a sample is ``(inputs, targets) = (window[:-1], window[1:])``, two int64 tensors of shape ``(seq_len,)``;
* the last window is padded with ``eos_id``; its padded target positions are :data:`IGNORE_INDEX`, which
  ``torch.nn.functional.cross_entropy`` skips by default.

A stream of fewer than two tokens has nothing to predict and gives no samples.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import IterableDataset, get_worker_info

__all__ = ["IGNORE_INDEX", "PackedStream", "pack_documents"]

#: Target value of padded positions; the default ``ignore_index`` of ``torch.nn.functional.cross_entropy``.
IGNORE_INDEX = -100


def _check(owner: str, seq_len: int) -> None:
    if seq_len < 1:
        raise ValueError(f"{owner}: `seq_len` must be ≥ 1, got {seq_len}.")


def pack_documents(token_lists: Iterable[Sequence[int]], seq_len: int, eos_id: int) -> tuple[Tensor, Tensor]:
    """Pack a corpus held in memory; returns ``(inputs, targets)``, two int64 tensors of shape ``(N, seq_len)``.

    Example::

        inputs, targets = pack_documents([[1, 2, 3], [4]], seq_len=4, eos_id=0)
        # stream 1 2 3 0 4 0 -> inputs [[1, 2, 3, 0], [4, 0, 0, 0]], targets [[2, 3, 0, 4], [0, -100, -100, -100]]
    """
    _check("pack_documents", seq_len)
    eos = np.array([eos_id], dtype=np.int64)
    pieces = []
    for doc in token_lists:
        pieces += [np.asarray(doc, dtype=np.int64), eos]
    stream = torch.from_numpy(np.concatenate(pieces)) if pieces else torch.empty(0, dtype=torch.int64)
    length = stream.numel()
    num_windows = max(0, -(-(length - 1) // seq_len))  # ceil((length - 1) / seq_len): every target covered
    padded = torch.full((num_windows * seq_len + 1,), eos_id, dtype=torch.int64)
    padded[:length] = stream
    targets = padded[1:].clone()
    targets[max(0, length - 1) :] = IGNORE_INDEX  # target j is stream position j + 1
    return padded[:-1].view(num_windows, seq_len), targets.view(num_windows, seq_len)


class PackedStream(IterableDataset):
    """Pack a streamed corpus on the fly, with the same samples :func:`pack_documents` gives for it.

    ``documents`` is iterated once per epoch, so it must be re-iterable (a list, a ``datasets`` dataset
    view, not a generator). The stream does not split documents across DataLoader workers itself: with
    ``num_workers > 0`` the wrapped iterable must do it (a ``datasets.IterableDataset`` does, by shard).
    ``max_samples`` caps the samples of one pass, all workers together.

    Example::

        stream = PackedStream([[1, 2, 3], [4]], seq_len=4, eos_id=0)
        [inputs.tolist() for inputs, _ in stream]  # [[1, 2, 3, 0], [4, 0, 0, 0]]
    """

    def __init__(
        self, documents: Iterable[Sequence[int]], seq_len: int, eos_id: int, max_samples: int | None = None
    ) -> None:
        _check("PackedStream", seq_len)
        if max_samples is not None and max_samples < 1:
            raise ValueError(f"PackedStream: `max_samples` must be ≥ 1 or None, got {max_samples}.")
        self.documents = documents
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.max_samples = max_samples

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        limit, worker = self.max_samples, get_worker_info()
        if limit is not None and worker is not None:
            # Each DataLoader worker packs its own share of the documents; together they stop at max_samples.
            limit = limit // worker.num_workers + (worker.id < limit % worker.num_workers)
        return itertools.islice(self._samples(), limit)

    def _samples(self) -> Iterator[tuple[Tensor, Tensor]]:
        buffer: list[int] = []
        for doc in self.documents:
            buffer.extend(doc)
            buffer.append(self.eos_id)
            start = 0
            while len(buffer) - start > self.seq_len:
                yield self._sample(buffer[start : start + self.seq_len + 1])
                start += self.seq_len
            # The last token of a window is the first input of the next one, so it stays in the buffer.
            del buffer[:start]
        if len(buffer) > 1:
            yield self._sample(buffer)

    def _sample(self, window: list[int]) -> tuple[Tensor, Tensor]:
        missing = self.seq_len + 1 - len(window)
        inputs = torch.tensor(window[:-1] + [self.eos_id] * missing, dtype=torch.int64)
        targets = torch.tensor(window[1:] + [IGNORE_INDEX] * missing, dtype=torch.int64)
        return inputs, targets
