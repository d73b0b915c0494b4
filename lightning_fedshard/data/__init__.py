"""The data pipeline for causal-LM pre-training: corpora, tokenizers, lossless packing and a data module."""

from lightning_fedshard.data.corpus import VALIDATION_MODULES, load_hub_corpus, load_text_corpus, stdlib_corpus
from lightning_fedshard.data.packing import IGNORE_INDEX, PackedStream, pack_documents
from lightning_fedshard.data.text import TextDataModule
from lightning_fedshard.data.tokenizer import ByteTokenizer, JSONTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "VALIDATION_MODULES",
    "ByteTokenizer",
    "JSONTokenizer",
    "PackedStream",
    "TextDataModule",
    "Tokenizer",
    "load_hub_corpus",
    "load_text_corpus",
    "load_tokenizer",
    "pack_documents",
    "stdlib_corpus",
]
