"""The compression benchmark: its pure helpers (fast) and a ``--quick`` smoke run (slow, not in CI)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from lightning_fedshard.bench.compression import SR_LABEL, bias, codec_rows, format_table, vnmse
from lightning_fedshard.dynamiq import CODECS
from tests.launching import run_isolated


def test_bias_and_vnmse_by_hand():
    exact = torch.tensor([3.0, 4.0])  # ‖S‖ = 5
    # two seeds average to (3, 5): off by (0, 1)
    assert bias([torch.tensor([4.0, 4.0]), torch.tensor([2.0, 6.0])], exact) == pytest.approx(0.2)
    # one deterministic run: the bias is its relative error
    assert bias([torch.tensor([3.0, 4.5])], exact) == pytest.approx(0.1)
    assert vnmse(torch.tensor([3.0, 4.5]), exact) == pytest.approx(0.01)


def test_format_table_aligns_columns():
    table = format_table(["a", "bb"], [["x", "1"], ["yyy", "22"]])
    assert table == "a    bb\n-------\nx     1\nyyy  22"


def test_codec_rows_cover_every_registered_codec():
    rows = codec_rows()
    assert {r.codec for r in rows} == set(CODECS)
    labels = [r.label for r in rows]
    assert len(labels) == len(set(labels))
    assert {"dynamiq 4.0", "dynamiq 5.0", "dynamiq 6.0", SR_LABEL, "mxfp8"} <= set(labels)
    assert [r.label for r in rows if r.stochastic] == ["thc (4 b)", SR_LABEL]


@pytest.mark.slow
def test_quick_run_writes_results(tmp_path):
    command = [sys.executable, "-m", "lightning_fedshard.bench", "compression", "--quick", "--skip-training"]
    done = run_isolated([*command, "--out", str(tmp_path)], timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["gloo_error"] is None
    assert list(report["codecs"]) == [r.label for r in codec_rows(quick=True)]
    for label, entry in report["codecs"].items():
        assert set(entry["vnmse"]) == {"lm_p4", "lm_p8", "gauss_p8", "t3_p8"}, label
        assert entry["gloo"]["replicas_identical"] and entry["gloo"]["equals_simulation"], label
        assert entry["gloo"]["bits"] == pytest.approx(entry["bits"]["lm_p4"], rel=1e-3), label
    assert report["codecs"]["none"]["vnmse"]["lm_p8"] < 1e-12
    assert report["target"]["pass"], report["target"]["line"]
    assert {row["codec"] for row in report["dar"]} >= {"dynamiq 5.0", "int8", "mxfp8"}
    assert report["training"] == "skipped"
    assert (tmp_path / "vnmse_vs_bits.png").stat().st_size > 0
