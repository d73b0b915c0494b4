import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

from lightning_fedshard.data import IGNORE_INDEX, PackedStream, pack_documents

EOS = 999


def _random_docs(seed, seq_len):
    """Documents of random lengths, including empty ones and ones longer than a window."""
    rng = np.random.default_rng(seed)
    lengths = [0, 3 * seq_len + 1, *rng.integers(0, 2 * seq_len + 2, size=int(rng.integers(1, 30))), 0]
    rng.shuffle(lengths)
    return [rng.integers(0, EOS, size=int(n)).tolist() for n in lengths]


def _stream(docs):
    return [t for doc in docs for t in [*doc, EOS]]


def _reconstruct(inputs, targets):
    """The token stream the samples cover: the first input, then every target that is not padding."""
    return [int(inputs[0, 0])] + targets[targets != IGNORE_INDEX].tolist()


CASES = [(seed, seq_len) for seed in range(4) for seq_len in (1, 2, 7, 64)]


@pytest.mark.parametrize(("seed", "seq_len"), CASES)
def test_packing_is_lossless(seed, seq_len):
    docs = _random_docs(seed, seq_len)
    stream = _stream(docs)
    inputs, targets = pack_documents(docs, seq_len, EOS)
    num = -(-(len(stream) - 1) // seq_len)
    assert inputs.shape == targets.shape == (num, seq_len)
    assert inputs.dtype == targets.dtype == torch.int64
    assert _reconstruct(inputs, targets) == stream
    for k in range(num):  # windows overlap by one token; the tail of the last one is eos padding
        window = stream[k * seq_len : k * seq_len + seq_len + 1]
        window += [EOS] * (seq_len + 1 - len(window))
        assert inputs[k].tolist() == window[:-1]
    # Padding only in the final window, exactly where the stream has run out.
    assert not (targets[:-1] == IGNORE_INDEX).any()
    assert (targets[-1] == IGNORE_INDEX).sum() == num * seq_len - (len(stream) - 1)


@pytest.mark.parametrize(("seed", "seq_len"), CASES)
def test_stream_yields_the_same_samples(seed, seq_len):
    docs = _random_docs(seed, seq_len)
    inputs, targets = pack_documents(docs, seq_len, EOS)
    samples = list(PackedStream(docs, seq_len, EOS))
    assert len(samples) == len(inputs)
    assert torch.equal(torch.stack([x for x, _ in samples]), inputs)
    assert torch.equal(torch.stack([y for _, y in samples]), targets)
    assert len(list(PackedStream(docs, seq_len, EOS))) == len(samples)  # re-iterable: one pass per epoch
    capped = list(PackedStream(docs, seq_len, EOS, max_samples=2))
    assert [x.tolist() for x, _ in capped] == inputs[:2].tolist()


class _WorkerShard:
    """Documents split across DataLoader workers, as a sharded ``datasets.IterableDataset`` splits them."""

    def __init__(self, docs):
        self.docs = docs

    def __iter__(self):
        worker = get_worker_info()
        return iter(self.docs[worker.id :: worker.num_workers] if worker else self.docs)


def test_max_samples_counts_all_workers_together():
    docs = [list(range(1, 40))] * 6  # 40 tokens each: 5 windows of 8 per document
    loader = DataLoader(PackedStream(_WorkerShard(docs), 8, EOS, max_samples=7), batch_size=None, num_workers=2)
    assert len(list(loader)) == 7
    assert len(list(DataLoader(PackedStream(_WorkerShard(docs), 8, EOS), batch_size=None, num_workers=2))) == 30


def test_corpus_shorter_than_one_window():
    inputs, targets = pack_documents([[5, 6], []], seq_len=8, eos_id=0)
    assert inputs.tolist() == [[5, 6, 0, 0, 0, 0, 0, 0]]
    assert targets.tolist() == [[6, 0, 0] + [IGNORE_INDEX] * 5]
    assert [(x.tolist(), y.tolist()) for x, y in PackedStream([[5, 6], []], 8, 0)] == [
        (inputs[0].tolist(), targets[0].tolist())
    ]


def test_numpy_documents_and_exact_fit():
    # 2 docs of 3 tokens + eos = 8 tokens = 1 + 7: exactly one window of seq_len 7, no padding at all.
    inputs, targets = pack_documents([np.arange(1, 4), np.arange(4, 7)], seq_len=7, eos_id=0)
    assert inputs.tolist() == [[1, 2, 3, 0, 4, 5, 6]]
    assert targets.tolist() == [[2, 3, 0, 4, 5, 6, 0]]


def test_nothing_to_predict():
    for docs in ([], [[]]):  # no tokens, or a lone eos: no target exists
        inputs, targets = pack_documents(docs, seq_len=4, eos_id=0)
        assert inputs.shape == targets.shape == (0, 4)
        assert list(PackedStream(docs, 4, 0)) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="pack_documents: `seq_len` must be ≥ 1, got 0"):
        pack_documents([[1]], seq_len=0, eos_id=0)
    with pytest.raises(ValueError, match="PackedStream: `seq_len` must be ≥ 1, got -1"):
        PackedStream([[1]], seq_len=-1, eos_id=0)
    with pytest.raises(ValueError, match="PackedStream: `max_samples` must be ≥ 1"):
        PackedStream([[1]], seq_len=4, eos_id=0, max_samples=0)
