"""``fedshard bench faults --state-mb``: the Llama shape picked for a state size holds that much state, and a
restart kind it does not know is refused before anything starts."""

from __future__ import annotations

import pytest
import torch

from lightning_fedshard.bench.faults import HEAL_BYTES_PER_PARAM, llama_overrides, main
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


def test_an_unknown_restart_kind_is_refused_before_any_process_starts(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["--state-mb", "64", "--restarts", "launch,elastic", "--out", str(tmp_path)])
    assert "--restarts: elastic is not one of launch, torchrun, job" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
