"""`fedshard bench optimizers`: the planner's state bytes against real optimizers, and the table's ratios."""

from __future__ import annotations

import pytest
import torch

from lightning_fedshard.bench.optimizers import OptimizerRun, format_runs, state_bytes_per_gpu
from lightning_fedshard.models import Llama, LlamaConfig
from lightning_fedshard.optim import AdamW8bit, BlockShardPlan, Muon, muon_param_groups
from lightning_fedshard.training import optimizer_state_bytes


def test_state_bytes_from_the_plan_are_what_the_optimizers_allocate():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_name("llama3.1-micro"))
    predicted = state_bytes_per_gpu(model, BlockShardPlan.for_module(model, world=1, block=128))
    made = {
        "adamw": torch.optim.AdamW(model.parameters()),
        "adamw8bit": AdamW8bit(model.parameters(), block_size=128),
        "muon": Muon(muon_param_groups(model)),
    }
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for name, optimizer in made.items():
        optimizer.step()
        steps = sum(1 for s in optimizer.state.values() if "step" in s)  # 4-byte step counters, left out
        assert optimizer_state_bytes(optimizer) - 4 * steps == predicted[name], name


def test_the_table_gives_ratios_to_adamw_of_the_same_layout():
    runs = [
        OptimizerRun("fsdp2", "adamw", 3e-3, 2.0, 1000.0, 800.0),
        OptimizerRun("fsdp2", "muon", 2e-2, 1.8, 900.0, 500.0),
        OptimizerRun("fl_hsdp", "adamw", 3e-3, 2.2, 2000.0, 1600.0),
        OptimizerRun("fl_hsdp", "adamw8bit", 3e-3, 2.2, 1000.0, 400.0),
    ]
    table = format_runs(runs).splitlines()
    assert "loss ×0.900  tokens/s ×0.90  state ×0.625" in table[3]
    assert "loss ×1.000  tokens/s ×0.50  state ×0.250" in table[5]
    assert table[3].split()[:3] == ["fsdp2", "muon", "2.0e-02"]


def test_the_lr_option_names_an_optimizer_and_a_positive_rate(capsys):
    from lightning_fedshard.bench.optimizers import main

    for bad in ("sgd=1e-2", "muon=fast", "muon=-1", "muon"):
        with pytest.raises(SystemExit):
            main(["--lr", bad])
        assert "--lr" in capsys.readouterr().err
