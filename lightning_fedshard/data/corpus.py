"""Where the text comes from: an embedded corpus, local files, or a Hugging Face Hub dataset.

Every loader returns a ``datasets`` dataset with a single ``"text"`` column, one row per document.
"""

from __future__ import annotations

import codecs
import glob
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    # imported where a corpus is loaded: the package (the verifier, the models) imports without `datasets`
    import datasets

__all__ = [
    "VALIDATION_MODULES",
    "check_text_files",
    "corpus_files",
    "load_hub_corpus",
    "load_text_corpus",
    "stdlib_corpus",
    "stdlib_sources",
]

#: Standard-library modules held out for validation; every CPython ships them.
VALIDATION_MODULES = ("difflib", "random", "string", "textwrap")

# One ``datasets`` builder reads all the files of a corpus, so a corpus may not mix builders.
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
#: Leading bytes of each text file checked before any process starts: a binary file fails within them, and
#: reading no more keeps the check cheap for a corpus of any size (a later bad byte is named when loading).
TEXT_CHECK_BYTES = 1 << 16
_READ_BYTES = 1 << 20


def stdlib_sources() -> list[Path]:
    """Top-level ``*.py`` files of the running interpreter's standard library, sorted so every rank agrees."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def stdlib_corpus(split: Literal["train", "val"]) -> datasets.Dataset:
    """The embedded default corpus, needing no download: one row per standard-library source file.

    Files whose stem is in :data:`VALIDATION_MODULES` form the ``"val"`` split, the others ``"train"``.
    """
    if split not in ("train", "val"):
        raise ValueError(f"stdlib_corpus: `split` must be 'train' or 'val', got {split!r}.")
    files = [f for f in stdlib_sources() if (f.stem in VALIDATION_MODULES) == (split == "val")]
    # Bytes, not read_text(): universal-newline decoding would rewrite any "\r\n" in the sources.
    import datasets

    return datasets.Dataset.from_dict({"text": [f.read_bytes().decode("utf-8") for f in files]})


def corpus_files(path: str | Path) -> list[Path]:
    """The files a corpus path names: the file itself, a directory's supported files, or a glob's matches.

    Cheap (no file is read), so callers check a path with it before any process group starts."""
    name = str(path)
    supported = ", ".join(_BUILDERS)
    if Path(path).is_dir():
        files = sorted(f for f in Path(path).rglob("*") if f.is_file() and f.suffix in _BUILDERS)
    elif Path(path).is_file():
        files = [Path(path)]
    elif any(c in name for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(name, recursive=True) if Path(f).is_file())
    else:
        raise FileNotFoundError(f"Text corpus {name!r} does not exist; pass a file, a directory or a glob.")
    if not files:
        raise FileNotFoundError(f"Text corpus: no {supported} files found at {name!r}.")
    unsupported = sorted({f.suffix for f in files} - set(_BUILDERS))
    if unsupported:
        raise ValueError(f"Text corpus {name!r} has files of unsupported type {unsupported}; use {supported}.")
    builders = {_BUILDERS[f.suffix] for f in files}
    if len(builders) > 1:
        raise ValueError(
            f"Text corpus {name!r} mixes file types {sorted({f.suffix for f in files})}; "
            "put each format in its own directory and use one of them."
        )
    if all(f.stat().st_size == 0 for f in files):
        raise ValueError(f"Text corpus at {name!r} is empty (all its files are empty).")
    return files


def check_text_files(files: list[Path], head_bytes: int | None = TEXT_CHECK_BYTES) -> None:
    """Raises a ``ValueError`` naming the first ``.txt``/``.jsonl``/``.json`` file that is not UTF-8 text (an
    invalid byte, or a NUL byte, which text does not hold). Only the first ``head_bytes`` of each file are read
    (``None``: all of it). Parquet files are binary by design and are left to their reader."""
    for file in files:
        if _BUILDERS.get(file.suffix) in ("text", "json"):
            _check_utf8(file, head_bytes)


def _check_utf8(file: Path, head_bytes: int | None) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, remaining = 0, head_bytes
    with file.open("rb") as stream:
        while (want := _READ_BYTES if remaining is None else min(_READ_BYTES, remaining)) > 0:
            chunk = stream.read(want)
            at_end = len(chunk) < want  # a character cut by the end of the head is not an error; by the file's, it is
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk, final=at_end)
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"Text corpus file {str(file)!r} is not UTF-8 text: byte {offset - pending + error.start} is"
                    f" invalid ({error.reason}). Convert it to UTF-8 or remove it from the corpus."
                ) from None
            if (nul := chunk.find(b"\0")) >= 0:
                raise ValueError(
                    f"Text corpus file {str(file)!r} is not UTF-8 text: byte {offset + nul} is NUL (binary data)."
                    " Remove it from the corpus."
                )
            offset += len(chunk)
            if remaining is not None:
                remaining -= len(chunk)
            if at_end:
                return


def load_text_corpus(
    path: str | Path, text_field: str = "text", cache_dir: str | Path | None = None
) -> datasets.Dataset:
    """Load a local corpus: ``.txt`` (one document per file), ``.jsonl``/``.json`` or ``.parquet`` (one per row).

    ``path`` is a file, a directory (its supported files, recursively, sorted) or a glob. ``text_field`` is
    the column holding the text in JSON and Parquet files; the result names it ``"text"``. ``cache_dir`` is
    where ``datasets`` keeps its Arrow copy (``None``: the default Hugging Face cache); nothing is downloaded.
    """
    files = corpus_files(path)
    check_text_files(files)
    builder = _BUILDERS[files[0].suffix]
    options = {"sample_by": "document"} if builder == "text" else {}
    import datasets

    try:
        corpus = datasets.load_dataset(
            builder,
            data_files=[str(f) for f in files],
            split="train",
            cache_dir=None if cache_dir is None else str(cache_dir),
            **options,
        )
    except Exception as e:  # datasets raises assorted types (even StopIteration) for empty or broken files
        check_text_files(files, head_bytes=None)  # a bad byte past the checked head: name its file
        raise ValueError(
            f"load_text_corpus: could not read the {builder} files at {str(path)!r} ({type(e).__name__}: {e}); "
            "check that they are well-formed and not empty."
        ) from e
    if builder == "text":
        text_field = "text"  # the text builder always names its column "text"
    if text_field not in corpus.column_names:
        raise ValueError(
            f"load_text_corpus: the corpus at {str(path)!r} has no column {text_field!r} "
            f"(columns: {corpus.column_names}); set `text_field` to the column holding the text."
        )
    if getattr(corpus.features[text_field], "dtype", None) not in ("string", "large_string"):
        raise ValueError(
            f"load_text_corpus: column {text_field!r} of {str(path)!r} holds {corpus.features[text_field]}, "
            "not strings; set `text_field` to the column holding the text."
        )
    corpus = corpus.select_columns([text_field])
    if text_field != "text":
        corpus = corpus.rename_column(text_field, "text")
    if not any(corpus["text"]):
        raise ValueError(f"load_text_corpus: the corpus at {str(path)!r} is empty (no document has any text).")
    return corpus


def load_hub_corpus(
    name: str, split: str = "train", config: str | None = None, text_field: str = "text"
) -> datasets.IterableDataset:
    """Stream a split of a Hugging Face Hub dataset (needs network access), e.g. ``"HuggingFaceFW/fineweb"``."""
    import datasets

    corpus = datasets.load_dataset(name, config, split=split, streaming=True)
    # Streamed datasets may not know their columns before the first row; then a wrong field fails on it.
    if corpus.column_names is not None and text_field not in corpus.column_names:
        raise ValueError(
            f"load_hub_corpus: split {split!r} of {name!r} has no column {text_field!r} "
            f"(columns: {corpus.column_names}); set `text_field` to the column holding the text."
        )
    corpus = corpus.select_columns([text_field])
    return corpus if text_field == "text" else corpus.rename_column(text_field, "text")
