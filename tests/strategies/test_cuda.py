"""The strategies' bf16 paths on GPUs: ``fsdp2`` with bf16-mixed and fused AdamW training Llama on one GPU (with and
without activation checkpointing), and FL+FSDP's bf16 shards averaged in fp32 over NCCL where there are two GPUs
(NCCL gives every rank a GPU of its own). Marked ``cuda``: ``pytest -m cuda`` runs them (``make gpu-check``); they
skip without CUDA."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from tests.launching import run_isolated
from tests.strategies.conftest import launch, load_ranks
from tests.strategies.test_fl_training import FL_FSDP_BF16_ACCUMULATE

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fsdp2_bf16_mixed_trains_llama_on_one_gpu(tmp_path, checkpointing: bool) -> None:
    kwargs = {"preset": "llama3.1-tiny", "steps": 6, "warmup": 2, "batch": 2, "seq_len": 128}
    command = [sys.executable, "-m", "lightning_fedshard.bench.gpu_check", "--child"]
    command += ["lightning_fedshard.bench.gpu_check:llama_throughput", "--result", str(tmp_path / "r.json")]
    command += ["--kwargs", json.dumps({**kwargs, "checkpointing": checkpointing})]
    result = run_isolated(command, timeout=240)
    assert result.returncode == 0, result.stderr[-6000:]
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["status"] == "pass", record
    (row,) = record["details"]
    assert row["optimizer"] == "AdamW (fused)" and row["compute dtype"] == "torch.bfloat16"
    assert row["activation checkpointing"] is checkpointing
    # An untrained model's loss over 257 byte tokens: the output layer (σ = dim^-0.5, truncated at ±3σ) over the
    # unit-RMS final norm gives logits of variance 0.9733, so cross-entropy ≈ log V + 0.9733 / 2 (not log V).
    assert abs(row["first loss"] - (math.log(257) + 0.9733 / 2)) < 0.3  # seeds on CPU: 5.95 … 6.16
    assert record["peak_cuda_bytes"] > 0


@pytest.mark.multiproc
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL: one GPU per rank)")
def test_fl_fsdp_bf16_shards_are_averaged_in_fp32_over_nccl(tmp_path) -> None:
    cfg = {**FL_FSDP_BF16_ACCUMULATE, "devices": 2, "accelerator": "cuda"}
    result = launch(cfg, tmp_path)
    assert result.returncode == 0, result.stderr[-6000:]
    ranks = load_ranks(tmp_path, 2)
    assert [s["step"] for s in ranks[0]["syncs"]] == [2, 4]
    for k in range(2):
        pre = [ranks[0]["syncs"][k]["pre"], ranks[1]["syncs"][k]["pre"]]  # one rank per group
        assert all(t.dtype == torch.bfloat16 for t in pre[0].values())
        fp32_mean = {n: ((pre[0][n].float() + pre[1][n].float()) / 2).to(torch.bfloat16) for n in pre[0]}
        for record in ranks:
            assert all(torch.equal(record["syncs"][k]["post"][n].cpu(), fp32_mean[n].cpu()) for n in fp32_mean)
