import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from lightning_fedshard.data import ByteTokenizer, JSONTokenizer, load_tokenizer

SENTENCES = ["the quick brown fox", "jumps over the lazy dog", "the dog sleeps"]


def _save_word_tokenizer(path, special_tokens):
    """A word-level tokenizer whose post-processor prepends a BOS token, as Llama's does."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["<unk>", "<bos>", *special_tokens]))
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
    )
    tok.save(str(path))
    return tok


def test_bytes_round_trip_non_ascii():
    tok = ByteTokenizer()
    text = "héllo wörld — 日本語 🎉\r\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.eos_id not in ids and max(ids) < 256
    assert tok.decode(ids + [tok.eos_id, -100]) == text
    assert (tok.vocab_size, tok.eos_id) == (257, 256)


def test_bytes_decode_replaces_a_cut_character():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"


def test_json_tokenizer_encodes_without_special_tokens(tmp_path):
    path = tmp_path / "tokenizer.json"
    raw = _save_word_tokenizer(path, ["<|end_of_text|>"])
    vocab = json.loads(path.read_text())["model"]["vocab"]
    tok = JSONTokenizer(path)
    text = "the lazy fox sleeps"
    assert raw.encode(text).ids[0] == vocab["<bos>"]  # the post-processor would add BOS ...
    assert tok.encode(text) == [vocab[w] for w in text.split()]  # ... but encode does not
    assert tok.eos_id == vocab["<|end_of_text|>"]
    assert tok.vocab_size == len(vocab)
    assert tok.decode(tok.encode(text) + [tok.eos_id]) == text


def test_json_tokenizer_eos_lookup_order_and_override(tmp_path):
    path = tmp_path / "tokenizer.json"
    _save_word_tokenizer(path, ["<|endoftext|>", "</s>"])
    vocab = json.loads(path.read_text())["model"]["vocab"]
    assert JSONTokenizer(path).eos_id == vocab["</s>"]  # "</s>" is tried before "<|endoftext|>"
    assert JSONTokenizer(path, eos_token="<|endoftext|>").eos_id == vocab["<|endoftext|>"]


def test_json_tokenizer_errors(tmp_path):
    path = tmp_path / "tokenizer.json"
    _save_word_tokenizer(path, [])
    with pytest.raises(ValueError, match=r"JSONTokenizer: .* none of the end-of-text tokens .*eos_token"):
        JSONTokenizer(path)
    with pytest.raises(ValueError, match=r"none of the end-of-text tokens \['<eot>'\]"):
        JSONTokenizer(path, eos_token="<eot>")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        JSONTokenizer(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json' is not a valid tokenizer.json"):
        JSONTokenizer(tmp_path / "broken.json")


def test_load_tokenizer(tmp_path):
    path = tmp_path / "tokenizer.json"
    _save_word_tokenizer(path, ["<|end_of_text|>"])
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)
    assert isinstance(load_tokenizer(str(path)), JSONTokenizer)
    with pytest.raises(FileNotFoundError, match="nope/tokenizer.json"):
        load_tokenizer("nope/tokenizer.json")
    with pytest.raises(FileNotFoundError, match="tok.json"):
        load_tokenizer("tok.json")
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt2'; use 'bytes'"):
        load_tokenizer("gpt2")
    with pytest.raises(ValueError, match="is a directory"):
        load_tokenizer(str(tmp_path))
