import math

import lightning.pytorch as pl
import pytest
import torch
from torch.nn import functional as F

from lightning_fedshard.data import IGNORE_INDEX, TextDataModule
from lightning_fedshard.training import LlamaPretraining


def trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_validation_loss_is_the_token_weighted_mean_and_ppl_its_exp():
    torch.manual_seed(0)
    data = TextDataModule(seq_len=32, batch_size=4, max_val_samples=10)  # batches of 4, 4 and 2 samples
    module = LlamaPretraining("llama3.1-micro", seq_len=32)
    metrics = trainer().validate(module, datamodule=data, verbose=False)[0]
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in data.val_dataloader():
            keep = targets != IGNORE_INDEX
            total += F.cross_entropy(module.model(inputs)[keep], targets[keep], reduction="sum").item()
            count += int(keep.sum())
    assert metrics["val_loss"] == pytest.approx(total / count, rel=1e-5)
    assert metrics["val_ppl"] == pytest.approx(math.exp(total / count), rel=1e-5)


def test_single_device_fit_uses_adamw_groups_and_the_schedule():
    data = TextDataModule(seq_len=16, batch_size=2)
    module = LlamaPretraining("llama3.1-micro", seq_len=16, lr=1e-3, warmup_fraction=0.5, min_lr_ratio=0.1)
    fitted = trainer(max_steps=4, limit_val_batches=0)
    fitted.fit(module, datamodule=data)
    optimizer = fitted.optimizers[0]
    assert isinstance(optimizer, torch.optim.AdamW)
    decayed, kept = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0.0
    assert {p.ndim for p in decayed["params"]} == {2} and {p.ndim for p in kept["params"]} == {1}
    assert len(decayed["params"]) + len(kept["params"]) == len(list(module.parameters()))
    assert decayed["betas"] == (0.9, 0.95)
    assert all(g["foreach"] and not g["fused"] for g in optimizer.param_groups)  # multi-tensor off CUDA
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.1)  # warm-up 2, cosine to the floor at 4
    assert not any(p.is_meta for p in module.parameters())  # no sharding strategy: built on the device


def test_module_arguments_are_checked_at_construction():
    with pytest.raises(ValueError, match="exceeds the rotary context"):
        LlamaPretraining("llama3.1-micro", seq_len=257)
    with pytest.raises(ValueError, match="warmup_fraction"):
        LlamaPretraining("llama3.1-micro", warmup_fraction=1.0)
    with pytest.raises(ValueError, match="has 300 ids"):
        LlamaPretraining("llama3.1-micro").check_vocab(300)


def test_a_gpt2_preset_trains_with_its_tied_head():
    data = TextDataModule(seq_len=16, batch_size=2)
    module = LlamaPretraining("gpt2-tiny", seq_len=16, overrides={"n_layers": 1}, lr=1e-2)
    fitted = trainer(max_steps=3, limit_val_batches=0)
    fitted.fit(module, datamodule=data)
    gpt2 = module.model
    assert type(gpt2).__name__ == "GPT2" and gpt2.config.n_layers == 1
    # the output head is the token embedding: no other matrix maps to the vocabulary, and the row of a token that
    # is not in the input still gets a gradient, through the head alone
    assert [p.shape for p in gpt2.parameters() if p.shape[0] == 257] == [(257, 128)]
    inputs = torch.randint(0, 200, (1, 16))
    gpt2.zero_grad()
    gpt2(inputs).logsumexp(-1).sum().backward()
    assert gpt2.tok_embeddings.weight.grad[256].abs().sum() > 0
    assert module.flops_per_batch == module.config.flops_per_token(16) * 2 * 16


def test_gpt2_presets_refuse_the_sharding_strategies():
    module = LlamaPretraining("gpt2-tiny", seq_len=16)
    module._trainer = type("T", (), {"strategy": pl.strategies.ModelParallelStrategy()})()
    with pytest.raises(ValueError, match="data-parallel strategies"):
        module.configure_model()


@pytest.mark.parametrize("name", ["adamw8bit", "muon"])
def test_single_device_fit_with_the_structure_aware_optimizers(name):
    from lightning_fedshard.optim import AdamW8bit, Muon

    module = LlamaPretraining("llama3.1-micro", seq_len=16, lr=1e-3, optimizer=name, quant_block=32)
    fitted = trainer(max_steps=2, limit_val_batches=0)
    fitted.fit(module, datamodule=TextDataModule(seq_len=16, batch_size=2))
    optimizer = fitted.optimizers[0]
    assert isinstance(optimizer, {"adamw8bit": AdamW8bit, "muon": Muon}[name])
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(module.parameters()))
    assert all(optimizer.state[p] for p in module.parameters())  # every parameter stepped
    if name == "muon":
        assert optimizer.orthogonalised == list(range(2 * 7))  # 7 matrices per block, both blocks
    with pytest.raises(ValueError, match="unknown `optimizer='sgd'`"):
        LlamaPretraining("llama3.1-micro", optimizer="sgd")
