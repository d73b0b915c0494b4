"""``fedshard bench faults --state-mb``: the Llama shape picked for a state size holds that much state."""

from __future__ import annotations

import pytest
import torch

from lightning_fedshard.bench.faults import HEAL_BYTES_PER_PARAM, llama_overrides
from lightning_fedshard.models.config import LlamaConfig
from lightning_fedshard.models.llama import Llama


@pytest.mark.parametrize("state_mb", [64, 512, 2048])
def test_the_shape_for_a_state_size_holds_that_state_within_fifteen_percent(state_mb):
    shape = llama_overrides(state_mb)
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("llama3.1-tiny", **shape))
    state = sum(p.numel() for p in model.parameters()) * HEAL_BYTES_PER_PARAM
    assert abs(state / (state_mb * 2**20) - 1) < 0.15, (shape, state)
    assert shape["n_layers"] * 128 - 2 * 128 <= shape["dim"] <= shape["n_layers"] * 128 + 2 * 128  # Llama 3's depth
