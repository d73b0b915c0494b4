"""``LlamaPretraining(float8=True)``: which layers torchao converts (the blocks' linear layers, never the embedding or
the output head), that they keep their initialisation, and the errors without torchao or on a GPU older than sm89.
The conversion itself needs torchao (the ``[float8]`` extra) and skips without it."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from lightning_fedshard.models import Llama, LlamaConfig
from lightning_fedshard.strategies.apply import materialize
from lightning_fedshard.training import LlamaPretraining
from lightning_fedshard.training.float8 import check_float8_device, convert_blocks_to_float8, float8_targets

BLOCK_LINEARS = ["attention.wk", "attention.wo", "attention.wq", "attention.wv", "feed_forward.w1"]
BLOCK_LINEARS += ["feed_forward.w2", "feed_forward.w3"]


def test_the_blocks_linear_layers_are_the_targets_not_the_head_nor_odd_shapes():
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("llama3.1-micro"))
        odd = Llama(LlamaConfig.from_name("llama3.1-micro", ffn_dim=120))  # 120 is not a multiple of 16
    assert sorted(float8_targets(model)) == sorted(f"layers.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS)
    assert sorted(float8_targets(odd)) == sorted(f"layers.{i}.attention.w{x}" for i in range(2) for x in "kvqo")


def test_float8_without_torchao_says_which_extra_to_install(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name))
    with pytest.raises(ImportError, match=r"lightning-fedshard\[float8\]"):
        LlamaPretraining("llama3.1-micro", float8=True)
    LlamaPretraining("llama3.1-micro")  # without float8 torchao is not needed


def test_float8_refuses_a_gpu_older_than_sm89_and_non_llama_presets(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match="A100-SXM4-80GB is sm80"):
        check_float8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_device(torch.device("cuda", 0))  # H100
    check_float8_device(torch.device("cpu"))  # torch's float8 matrix product, for tests
    with pytest.raises(ValueError, match="compute capability"):
        check_float8_device(torch.device("mps"))
    if importlib.util.find_spec("torchao") is not None:
        with pytest.raises(ValueError, match="not a Llama preset"):
            LlamaPretraining("gpt2-tiny", float8=True)


def test_converted_layers_are_float8_and_keep_their_initialisation():
    pytest.importorskip("torchao.float8", reason="needs the [float8] extra (torchao)")
    from torchao.float8.float8_linear import Float8Linear

    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("llama3.1-micro"))
    converted = convert_blocks_to_float8(model)
    assert converted == sorted(float8_targets(model))
    assert all(isinstance(model.get_submodule(name), Float8Linear) for name in converted)
    assert not isinstance(model.output, Float8Linear) and isinstance(model.tok_embeddings, nn.Embedding)
    torch.manual_seed(0)
    holder = nn.Module()
    holder.model = model
    materialize(holder, torch.device("cpu"))  # each module's reset_parameters(), as the strategies do
    # the blocks' truncated normals (σ = 0.02, and 0.02/√(2(l+1)) for the output projections), not nn.Linear's
    # kaiming-uniform default (σ = 1/√(3·64) = 0.072 here)
    assert model.layers[0].attention.wq.weight.std().item() == pytest.approx(0.02 * 0.9866, rel=0.05)
    assert model.layers[1].feed_forward.w2.weight.std().item() == pytest.approx(0.01 * 0.9866, rel=0.05)
