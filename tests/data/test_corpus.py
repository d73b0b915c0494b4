import json
import sysconfig
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_fedshard.data import VALIDATION_MODULES, load_hub_corpus, load_text_corpus, stdlib_corpus
from lightning_fedshard.data.corpus import TEXT_CHECK_BYTES, check_text_files


@pytest.fixture(autouse=True)
def _private_hf_cache(tmp_path_factory, monkeypatch):
    # load_dataset keeps an Arrow copy of every corpus: not in the user's cache, nor in a corpus directory.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf-cache"))


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_stdlib_split():
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    val_files = [f for f in files if f.stem in VALIDATION_MODULES]
    train_files = [f for f in files if f.stem not in VALIDATION_MODULES]
    assert sorted(f.stem for f in val_files) == sorted(VALIDATION_MODULES)
    val, train = stdlib_corpus("val"), stdlib_corpus("train")
    assert val.column_names == train.column_names == ["text"]
    assert val["text"] == [f.read_bytes().decode() for f in val_files]
    assert train["text"] == [f.read_bytes().decode() for f in train_files]
    assert not set(val["text"]) & set(train["text"])
    with pytest.raises(ValueError, match="stdlib_corpus: `split` must be 'train' or 'val', got 'test'"):
        stdlib_corpus("test")


def test_txt_directory_file_and_glob(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    texts = {"b.txt": "second\n\nparagraph", "a.txt": "first document\n", "sub/c.txt": "nested ünïcode"}
    for name, text in texts.items():
        (root / name).write_text(text, encoding="utf-8")
    (root / "README.md").write_text("not a corpus file")
    expected = [texts["a.txt"], texts["b.txt"], texts["sub/c.txt"]]  # one document per file, sorted by path
    assert load_text_corpus(root, cache_dir=tmp_path / "c")["text"] == expected
    assert load_text_corpus(str(root / "b.txt"))["text"] == [texts["b.txt"]]
    assert load_text_corpus(f"{root}/*.txt")["text"] == expected[:2]
    assert load_text_corpus(f"{root}/**/*.txt")["text"] == expected


def test_jsonl_json_and_parquet_with_custom_field(tmp_path):
    rows = [{"id": i, "content": f"document number {i}"} for i in range(5)]
    expected = [row["content"] for row in rows]
    _write_jsonl(tmp_path / "a.jsonl", rows[:3])
    _write_jsonl(tmp_path / "b.jsonl", rows[3:])
    (tmp_path / "array.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    for path in (f"{tmp_path}/*.jsonl", tmp_path / "array.json", tmp_path / "rows.parquet"):
        corpus = load_text_corpus(path, text_field="content")
        assert corpus.column_names == ["text"]
        assert corpus["text"] == expected
    _write_jsonl(tmp_path / "plain.jsonl", [{"text": "x"}, {"text": "y"}])
    assert load_text_corpus(tmp_path / "plain.jsonl")["text"] == ["x", "y"]


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'.*nowhere' does not exist"):
        load_text_corpus(tmp_path / "nowhere")
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"no \.txt, \.jsonl, \.json, \.parquet files found at"):
        load_text_corpus(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no .* files found at '.*\*\.jsonl'"):
        load_text_corpus(f"{tmp_path}/*.jsonl")


def test_empty_corpora(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"corpus at '.*empty.txt' is empty \(all its files are empty\)"):
        load_text_corpus(tmp_path / "empty.txt")
    _write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(ValueError, match=r"corpus at '.*blank.jsonl' is empty \(no document has any text\)"):
        load_text_corpus(tmp_path / "blank.jsonl")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "norows.parquet")
    with pytest.raises(ValueError, match=r"could not read the parquet files at '.*norows.parquet'.*not empty"):
        load_text_corpus(tmp_path / "norows.parquet")


def test_bad_columns_and_file_types(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", [{"body": "x", "n": 1}])
    with pytest.raises(ValueError, match=r"no column 'text' \(columns: \['body', 'n'\]\); set `text_field`"):
        load_text_corpus(tmp_path / "a.jsonl")
    with pytest.raises(ValueError, match=r"column 'n' of '.*a.jsonl' holds Value\('int64'\), not strings"):
        load_text_corpus(tmp_path / "a.jsonl", text_field="n")
    (tmp_path / "b.txt").write_text("y")
    with pytest.raises(ValueError, match=r"mixes file types \['.jsonl', '.txt'\]"):
        load_text_corpus(tmp_path)
    (tmp_path / "c.csv").write_text("text\nz\n")
    with pytest.raises(ValueError, match=r"unsupported type \['.csv'\]"):
        load_text_corpus(tmp_path / "c.csv")


def test_hub_corpus_streams_the_text_column(monkeypatch):
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        rows = {"id": [1, 2], "content": ["hello", "world"]}
        return datasets.Dataset.from_dict(rows).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    corpus = load_hub_corpus("org/web", split="train", config="en", text_field="content")
    assert calls == [(("org/web", "en"), {"split": "train", "streaming": True})]
    assert isinstance(corpus, datasets.IterableDataset)
    assert list(corpus) == [{"text": "hello"}, {"text": "world"}]
    with pytest.raises(ValueError, match=r"load_hub_corpus: split 'train' of 'org/web' has no column 'body'"):
        load_hub_corpus("org/web", text_field="body")


def test_binary_files_are_named_as_not_utf8_text_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("the corpus was loaded"))
    (tmp_path / "good.txt").write_text("plain text, and ünïcode\n", encoding="utf-8")
    (tmp_path / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    with pytest.raises(ValueError, match=r"file '.*image\.txt' is not UTF-8 text: byte 0 is invalid"):
        load_text_corpus(tmp_path)
    (tmp_path / "image.txt").unlink()
    (tmp_path / "zeros.txt").write_bytes(b"text\0\0\0")  # decodes, but no text holds NUL bytes
    with pytest.raises(ValueError, match=r"file '.*zeros\.txt' is not UTF-8 text: byte 4 is NUL"):
        load_text_corpus(tmp_path)
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"file '.*latin1\.jsonl' is not UTF-8 text: byte 13 is invalid"):
        check_text_files([tmp_path / "latin1.jsonl"])


def test_a_bad_byte_past_the_checked_head_is_named_when_loading(tmp_path):
    head = TEXT_CHECK_BYTES
    # a two-byte character across the end of the checked head is valid text, not a cut-off error
    straddling = "a" * (head - 1) + "é" + "b" * 10
    (tmp_path / "long.txt").write_bytes(straddling.encode("utf-8"))
    assert load_text_corpus(tmp_path / "long.txt", cache_dir=tmp_path / "c1")["text"] == [straddling]
    (tmp_path / "late.txt").write_bytes(b"a" * (head + 100) + b"\xff" + b"tail")
    check_text_files([tmp_path / "late.txt"])  # the head is fine
    with pytest.raises(ValueError, match=rf"file '.*late\.txt' is not UTF-8 text: byte {head + 100} is invalid"):
        load_text_corpus(tmp_path / "late.txt", cache_dir=tmp_path / "c2")
    (tmp_path / "cut.txt").write_bytes("ends mid-character é".encode()[:-1])
    with pytest.raises(ValueError, match=r"file '.*cut\.txt' is not UTF-8 text: byte 19 is invalid"):
        check_text_files([tmp_path / "cut.txt"])
