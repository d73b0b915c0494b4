import itertools
import json
import warnings
from types import SimpleNamespace

import datasets
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.fabric.utilities.types import _Stateful
from torch.utils.data import DistributedSampler

from lightning_fedshard.data import IGNORE_INDEX, VALIDATION_MODULES, TextDataModule, pack_documents
from lightning_fedshard.data.corpus import stdlib_sources

EOS = 256  # ByteTokenizer


@pytest.fixture(autouse=True)
def _private_hf_cache(tmp_path_factory, monkeypatch):
    # load_dataset keeps an Arrow copy of every corpus: not in the user's cache, nor in a corpus directory.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf-cache"))


@pytest.fixture(scope="module")
def stdlib_dm():
    dm = TextDataModule(seq_len=256, batch_size=8)
    dm.setup("fit")
    return dm


def _stream(dataset):
    """The token stream a packed dataset covers: its first input, then every target that is not padding."""
    inputs, targets = dataset.tensors
    return torch.cat([inputs[:1, 0], targets[targets != IGNORE_INDEX]])


def _documents(dataset):
    """The byte documents a packed dataset holds (every document ends with eos)."""
    stream = _stream(dataset).tolist()
    return {bytes(doc).decode() for doc in _split(stream)}


def _split(stream):
    docs, current = [], []
    for token in stream:
        if token == EOS:
            docs.append(current)
            current = []
        else:
            current.append(token)
    assert not current, "the stream must end with eos"
    return docs


def _write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def test_stdlib_samples_are_the_sources(stdlib_dm):
    assert stdlib_dm.vocab_size == 257
    for split, is_val in (("train", False), ("val", True)):
        files = [f for f in stdlib_sources() if (f.stem in VALIDATION_MODULES) == is_val]
        expected = torch.from_numpy(
            np.concatenate([np.append(np.frombuffer(f.read_bytes(), dtype=np.uint8), EOS) for f in files])
        )
        loader = stdlib_dm.train_dataloader() if split == "train" else stdlib_dm.val_dataloader()
        assert torch.equal(_stream(loader.dataset), expected)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = stdlib_dm.train_dataloader()
    assert not [w for w in caught if "set_vital" in str(w.message)]  # torchdata's known noise is filtered
    inputs, targets = next(iter(loader))
    assert inputs.shape == targets.shape == (8, 256) and inputs.dtype == targets.dtype == torch.int64
    real = targets[:, :-1] != IGNORE_INDEX  # targets are the inputs shifted by one, except at padding
    assert torch.equal(inputs[:, 1:][real], targets[:, :-1][real])


def test_ranks_read_disjoint_samples_that_cover_the_data(stdlib_dm, monkeypatch):
    seen, totals = {"train": [], "val": []}, {}
    for rank in range(4):
        monkeypatch.setattr(stdlib_dm, "_rank_and_world", lambda rank=rank: (rank, 4))
        for split, loader in (("train", stdlib_dm.train_dataloader()), ("val", stdlib_dm.val_dataloader())):
            indices = list(loader.sampler)
            inputs, targets = next(iter(loader))
            assert torch.equal(inputs, loader.dataset.tensors[0][indices[: len(inputs)]])
            assert torch.equal(targets, loader.dataset.tensors[1][indices[: len(inputs)]])
            seen[split].append(set(indices))
            totals[split] = len(loader.dataset)
    train_total, val_total = totals["train"], totals["val"]
    assert all(not a & b for a, b in itertools.combinations(seen["train"], 2))
    train_covered = set().union(*seen["train"])
    assert train_covered <= set(range(train_total)) and train_total - len(train_covered) < 4  # drop_last: < W
    # Validation drops nothing: it covers every sample, repeating at most W - 1 to even out the ranks.
    assert set().union(*seen["val"]) == set(range(val_total))
    assert sum(map(len, seen["val"])) - val_total < 4


def test_rank_and_world_come_from_the_trainer(stdlib_dm, monkeypatch):
    assert stdlib_dm._rank_and_world() == (0, 1)
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 8, "rank": 5})
    monkeypatch.setattr(stdlib_dm, "trainer", SimpleNamespace(strategy=strategy, global_rank=1, world_size=2))
    sampler = stdlib_dm.train_dataloader().sampler
    assert isinstance(sampler, DistributedSampler) and (sampler.rank, sampler.num_replicas) == (5, 8)
    strategy.distributed_sampler_kwargs = None  # a single-device strategy: the trainer's own rank and size
    assert stdlib_dm._rank_and_world() == (1, 2)


def test_same_seed_same_batches_new_epoch_new_order(stdlib_dm):
    first, second = stdlib_dm.train_dataloader(), stdlib_dm.train_dataloader()
    for a, b in itertools.islice(zip(first, second, strict=True), 5):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    epoch0 = list(first.sampler)
    first.sampler.set_epoch(1)
    epoch1 = list(first.sampler)
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1)
    assert not torch.equal(next(iter(first))[0], next(iter(second))[0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_continues_with_the_next_batch(num_workers):
    def loader(dm):
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(3)  # Lightning sets the epoch before iterating, on resume too
        return loader

    dm = TextDataModule(seq_len=256, batch_size=64, num_workers=num_workers)
    dm.setup("fit")
    reference = list(loader(dm))
    interrupted = loader(dm)
    assert isinstance(interrupted, _Stateful)
    batches = iter(interrupted)
    for k in range(5):
        assert torch.equal(next(batches)[0], reference[k][0])
    state = interrupted.state_dict()

    fresh = TextDataModule(seq_len=256, batch_size=64, num_workers=num_workers)
    fresh.setup("fit")
    resumed = loader(fresh)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(reference) - 5
    for got, want in zip(rest, reference[5:], strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_local_validation_split_is_deterministic_and_disjoint(tmp_path):
    texts = [f"document {i}: " + "abcdefgh"[: i % 8] * (i + 3) for i in range(20)]
    source = _write_jsonl(tmp_path / "docs.jsonl", texts)

    def split_documents(seed):
        dm = TextDataModule(source=source, seq_len=16, batch_size=4, val_fraction=0.2, seed=seed)
        dm.setup("fit")
        return _documents(dm.train_dataloader().dataset), _documents(dm.val_dataloader().dataset)

    train, val = split_documents(seed=1)
    assert len(val) == 4 and not train & val and train | val == set(texts)
    assert split_documents(seed=1) == (train, val)
    assert split_documents(seed=2)[1] != val


def test_short_validation_split_is_padded(tmp_path):
    for i in range(20):
        (tmp_path / f"{i:02}.txt").write_text("ab")
    dm = TextDataModule(source=str(tmp_path), seq_len=64, batch_size=1, val_fraction=0.05)
    dm.setup("fit")
    (inputs, targets) = next(iter(dm.val_dataloader()))
    assert inputs.tolist() == [[97, 98] + [EOS] * 62]
    assert targets.tolist() == [[98, EOS] + [IGNORE_INDEX] * 62]
    assert len(list(dm.train_dataloader())) == 1  # 19 documents, 57 tokens: one padded window


def test_empty_splits_and_tiny_corpora_fail_clearly(tmp_path):
    texts = ["", "x" * 100]
    source = _write_jsonl(tmp_path / "docs.jsonl", texts)
    halves = [datasets.Dataset.from_dict({"text": texts}).train_test_split(0.5, seed=s) for s in range(10)]
    val_empty = next(s for s, h in enumerate(halves) if h["test"]["text"] == [""])
    train_empty = next(s for s, h in enumerate(halves) if h["train"]["text"] == [""])
    dm = TextDataModule(source=source, seq_len=8, batch_size=1, val_fraction=0.5, seed=val_empty)
    with pytest.raises(ValueError, match=r"the val split of '.*docs.jsonl' packs into no samples"):
        dm.setup("validate")
    dm = TextDataModule(source=source, seq_len=8, batch_size=1, val_fraction=0.5, seed=train_empty)
    with pytest.raises(ValueError, match=r"the train split of '.*docs.jsonl' packs into no samples"):
        dm.setup("fit")
    dm = TextDataModule(source=_write_jsonl(tmp_path / "one.jsonl", ["lonely"]), seq_len=8)
    with pytest.raises(ValueError, match=r"cannot hold out val_fraction=0.05 of the 1 documents"):
        dm.setup("fit")
    source = _write_jsonl(tmp_path / "two.jsonl", ["x" * 100, "y" * 100])
    dm = TextDataModule(source=source, seq_len=8, batch_size=64, val_fraction=0.5)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"rank 0 of 1 gets 13 training samples, fewer than batch_size=64"):
        dm.train_dataloader()


def test_max_val_samples(tmp_path):
    source = _write_jsonl(tmp_path / "docs.jsonl", [f"text number {i} " * 20 for i in range(10)])
    full, capped = (TextDataModule(source=source, seq_len=8, max_val_samples=m) for m in (None, 3))
    full.setup("validate")
    capped.setup("validate")
    assert len(capped.val_dataloader().dataset) == 3 < len(full.val_dataloader().dataset)
    assert torch.equal(capped.val_dataloader().dataset.tensors[0], full.val_dataloader().dataset.tensors[0][:3])


def test_bad_arguments_fail_before_setup(tmp_path):
    source = _write_jsonl(tmp_path / "docs.jsonl", ["a", "b"])
    (binary := tmp_path / "bin" / "blob.txt").parent.mkdir()
    binary.write_bytes(b"\x00\xff\xfe binary")
    for kwargs, error, message in [
        ({"seq_len": 0}, ValueError, "`seq_len` must be ≥ 1, got 0"),
        ({"batch_size": 0}, ValueError, "`batch_size` must be ≥ 1, got 0"),
        ({"num_workers": -1}, ValueError, "`num_workers` must be ≥ 0, got -1"),
        ({"val_fraction": 1.0}, ValueError, r"`val_fraction` must be between 0 and 1 \(exclusive\), got 1.0"),
        ({"val_fraction": 0}, ValueError, "`val_fraction` must be between 0 and 1"),
        ({"max_val_samples": 0}, ValueError, "`max_val_samples` must be ≥ 1 or None, got 0"),
        ({"tokenizer": "gpt2"}, ValueError, "unknown tokenizer 'gpt2'"),
        ({"tokenizer": "llama/tokenizer.json"}, FileNotFoundError, "llama/tokenizer.json"),
        ({"source": str(tmp_path / "missing")}, FileNotFoundError, r"'.*missing' does not exist"),
        ({"source": str(tmp_path / "*.parquet")}, FileNotFoundError, r"no .* files found at '.*\*\.parquet'"),
        ({"source": "hf://"}, ValueError, "names no dataset"),
        ({"source": str(binary)}, ValueError, r"file '.*blob\.txt' is not UTF-8 text: byte 1 is invalid"),
    ]:
        with pytest.raises(error, match=message):
            TextDataModule(**{"source": source, **kwargs})
    with pytest.raises(RuntimeError, match=r"call `setup\(\)` before asking for the train dataloader"):
        TextDataModule(source=source).train_dataloader()


def test_hub_source_is_streamed_per_rank(monkeypatch):
    texts = [f"streamed document {i} " * (i % 5 + 1) for i in range(12)]
    requested = []

    def fake_load_dataset(name, config, split, streaming):
        requested.append((name, config, split, streaming))
        return datasets.Dataset.from_dict({"body": texts, "n": list(range(12))}).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dm = TextDataModule(
        source="hf://org/web", hub_config="en", text_field="body", seq_len=8, batch_size=2, max_val_samples=3
    )
    dm.setup("fit")
    assert requested == [("org/web", "en", "train", True), ("org/web", "en", "validation", True)]
    for rank in range(2):
        monkeypatch.setattr(dm, "_rank_and_world", lambda rank=rank: (rank, 2))
        # split_dataset_by_node gives rank r every other document of a single-shard stream.
        inputs, targets = pack_documents([list(t.encode()) for t in texts[rank::2]], 8, EOS)
        batches = list(dm.train_dataloader())
        assert torch.equal(torch.cat([x for x, _ in batches]), inputs[: 2 * len(batches)])
        assert torch.equal(torch.cat([y for _, y in batches]), targets[: 2 * len(batches)])
        assert len(inputs) - 2 * len(batches) < 2  # only the last partial batch is dropped
        assert sum(len(x) for x, _ in dm.val_dataloader()) == 2  # ceil(3 / 2) per rank
    dm = TextDataModule(source="hf://org/web", text_field="body", hub_val_split=None)
    dm.setup("fit")
    assert dm.val_dataloader() == []


class _Recorder(pl.LightningModule):
    """Records the batches it trains on."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(EOS + 1, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        inputs, _ = batch
        self.seen.append(inputs.clone())
        return self.embedding(inputs).mean()

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_resumes_mid_epoch_from_a_checkpoint(tmp_path):
    source = _write_jsonl(tmp_path / "docs.jsonl", [f"line {i} " * 30 for i in range(30)])

    def fit(max_steps, ckpt_path=None, callbacks=()):
        model = _Recorder()
        trainer = pl.Trainer(
            max_steps=max_steps,
            limit_val_batches=0,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=bool(callbacks),
            callbacks=list(callbacks),
            default_root_dir=tmp_path,
        )
        trainer.fit(model, TextDataModule(source=source, seq_len=32, batch_size=4), ckpt_path=ckpt_path)
        return model.seen

    reference = fit(6)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    interrupted = fit(3, callbacks=[checkpoint])
    resumed = fit(6, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    # Lightning prefetches a batch; the checkpointed loader position must still be that of the last step.
    assert len(interrupted) == len(resumed) == 3
    for got, want in zip(interrupted + resumed, reference, strict=True):
        assert torch.equal(got, want)
