"""``Trainer(strategy="fl_hsdp")`` with Lightning's demo Transformer on one node of 4 real processes: the name alone
gets a layout with every dimension it promises (``hsdp`` by name on 4 processes: tests/strategies/test_faults.py)."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests.launching import run_isolated

pytestmark = pytest.mark.multiproc


def test_fl_hsdp_by_name_trains_the_demo_transformer_on_2_groups_of_2_replicas(tmp_path):
    result = run_isolated([sys.executable, "-m", "tests.strategies.by_name", "fl_hsdp", "4", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-6000:]
    assert "FLHSDPStrategy: 2 groups × 2 replicas × 1 shard over 1 node(s) × 4 device(s), derived" in result.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["shape"] for r in ranks] == [[2, 2, 1]] * 4
    assert [r["coordinate"] for r in ranks] == [[0, 0, 0], [0, 1, 0], [1, 0, 0], [1, 1, 0]]
    assert all(len(r["losses"]) == 2 and all(map(math.isfinite, r["losses"])) for r in ranks)
