"""Tokenizers for pre-training: raw UTF-8 bytes (no files needed) or a Hugging Face ``tokenizer.json``."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import tokenizers

__all__ = ["ByteTokenizer", "JSONTokenizer", "Tokenizer", "load_tokenizer"]

#: Tried in order when no ``eos_token`` is given: Llama 3, Llama 2 / SentencePiece, GPT-2 style vocabularies.
DEFAULT_EOS_TOKENS = ("<|end_of_text|>", "</s>", "<|endoftext|>")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer.

    ``encode`` never adds special tokens: the packer appends ``eos_id`` after each document itself, so a
    tokenizer that also added BOS/EOS would put them in the stream twice.
    """

    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; 256 is end-of-document.

    Example::

        tok = ByteTokenizer()
        tok.encode("hé")  # [104, 195, 169]
        tok.decode([104, 195, 169, tok.eos_id])  # "hé"
    """

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        # Ids outside the byte range (eos, IGNORE_INDEX padding) carry no text; a window may also cut a
        # multi-byte character in half, hence the replacement character rather than an error.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class JSONTokenizer:
    """A Hugging Face ``tokenizer.json`` (e.g. Llama 3.1's) loaded with the ``tokenizers`` library.

    Example::

        tok = JSONTokenizer("Llama-3.1-8B/tokenizer.json")  # eos_id is the id of "<|end_of_text|>"
        ids = tok.encode("Hello world")  # no <|begin_of_text|>: special tokens are never added
    """

    def __init__(self, path: str | Path, eos_token: str | None = None) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"JSONTokenizer: no tokenizer file at {str(path)!r}; pass a path to a tokenizer.json."
            )
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust loader raises a bare Exception for malformed files
            raise ValueError(f"JSONTokenizer: {str(path)!r} is not a valid tokenizer.json ({e}).") from e
        candidates = DEFAULT_EOS_TOKENS if eos_token is None else (eos_token,)
        eos_id = next((i for i in map(self._tokenizer.token_to_id, candidates) if i is not None), None)
        if eos_id is None:
            raise ValueError(
                f"JSONTokenizer: {str(path)!r} has none of the end-of-text tokens {list(candidates)}; "
                "pass `eos_token=` with the token that ends a document in this vocabulary."
            )
        self.eos_id: int = eos_id
        #: The file itself: an export (``fedshard export``) copies it next to the model.
        self.path = path
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids if i >= 0])


def load_tokenizer(spec: str) -> ByteTokenizer | JSONTokenizer:
    """``"bytes"`` gives a :class:`ByteTokenizer`, a path to a ``tokenizer.json`` a :class:`JSONTokenizer`.

    A spec that looks like a path (it ends in ``.json`` or contains a path separator) but does not exist
    raises :class:`FileNotFoundError`; any other unknown spec raises :class:`ValueError`.
    """
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_file():
        return JSONTokenizer(path)
    if path.is_dir():
        raise ValueError(f"load_tokenizer: {spec!r} is a directory; pass the path of its tokenizer.json file.")
    if spec.endswith(".json") or "/" in spec or "\\" in spec:
        raise FileNotFoundError(f"load_tokenizer: no tokenizer file at {spec!r}; check the path.")
    raise ValueError(f"load_tokenizer: unknown tokenizer {spec!r}; use 'bytes' or a path to a tokenizer.json file.")
