"""Save → load → continue reproduces the uninterrupted FL run, including the sync phase and DiLoCo state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.strategies.conftest import launch, load_ranks

pytestmark = pytest.mark.multiproc

# 4 ranks × batch 4 over 32 samples: 2 steps per epoch, so every checkpoint falls on an epoch boundary.
BASE = {
    "strategy": "fl_fsdp",
    "strategy_kwargs": {
        "num_groups": 2,
        "sync_every": 4,
        "outer_optimizer": "nesterov",
        "auto_wrap": ["__main__.Block"],
    },
    "devices": 4,
    "lr": 0.01,
    "optimizer": "adamw",
    "batch_size": 4,
    "num_samples": 32,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("ckpt")
    ckpt_dir = root / "checkpoints"
    plans = {
        "uninterrupted": {**BASE, "max_steps": 12},
        # ModelCheckpoint saves every 2 steps: step 8 is right after a sync, step 6 is mid-round
        "first_part": {**BASE, "max_steps": 8, "checkpoint_every": 2, "checkpoint_dir": str(ckpt_dir)},
    }
    results = {}
    for name, cfg in plans.items():
        results[name] = _run(cfg, root / name)
    (step6,) = ckpt_dir.glob("*step=6.ckpt")
    (step8,) = ckpt_dir.glob("*step=8.ckpt")
    results["resumed_after_sync"] = _run({**BASE, "max_steps": 12, "resume_from": str(step8)}, root / "resume8")
    results["resumed_mid_round"] = _run({**BASE, "max_steps": 12, "resume_from": str(step6)}, root / "resume6")
    results["paths"] = {"step6": step6, "step8": step8}
    return results


def _run(cfg: dict, out: Path) -> list[dict]:
    result = launch(cfg, out)
    assert result.returncode == 0, result.stderr[-6000:]
    return load_ranks(out, cfg["devices"])


def test_checkpoint_keeps_each_group_apart(runs):
    step8: Path = runs["paths"]["step8"]
    assert sorted(p.name for p in step8.iterdir()) == ["group0", "group1", "meta.pt"]
    meta = torch.load(step8 / "meta.pt", weights_only=True)
    assert meta["fedshard"]["optimizer_steps"] == 8 and meta["fedshard"]["num_groups"] == 2


@pytest.mark.parametrize(("resumed", "from_step"), [("resumed_after_sync", 8), ("resumed_mid_round", 6)])
def test_resume_reproduces_the_uninterrupted_run(runs, resumed, from_step):
    full, part = runs["uninterrupted"], runs[resumed]
    for rank, (a, b) in enumerate(zip(full, part, strict=True)):
        assert b["losses"] == pytest.approx(a["losses"][from_step:], rel=1e-6, abs=1e-7), f"rank {rank}"
        for name in a["final"]:
            torch.testing.assert_close(b["final"][name], a["final"][name], rtol=1e-6, atol=1e-7)
        # the sync phase survives: syncs stay at multiples of sync_every
        assert [s["step"] for s in b["syncs"]] == [s for s in (8, 12) if s > from_step]
        assert b["optimizer_steps"] == 12 and b["syncs_count"] == 3


def test_mid_round_checkpoint_holds_diverged_groups(runs):
    """Between syncs the groups differ; their checkpoint must restore each group's own parameters."""
    first = runs["first_part"]
    step6 = [first[0]["params"][5], first[2]["params"][5]]
    assert any(not torch.equal(step6[0][n], step6[1][n]) for n in step6[0])
    resumed = runs["resumed_mid_round"]
    for rank, group_params in ((0, step6[0]), (2, step6[1])):
        assert all(torch.equal(resumed[rank]["initial"][n], group_params[n]) for n in group_params)


def test_resuming_with_another_mesh_fails_on_every_rank_with_the_layout(runs, tmp_path):
    cfg = {
        **BASE,
        "strategy": "fsdp2",
        "strategy_kwargs": {"auto_wrap": ["__main__.Block"], "outer_optimizer": "nesterov"},
    }
    result = launch({**cfg, "max_steps": 12, "resume_from": str(runs["paths"]["step8"])}, tmp_path)
    assert result.returncode != 0
    assert "was saved with mesh {'num_groups': 2, 'replicate_size': 1, 'shard_size': 2}" in result.stderr
    assert "this run uses {'num_groups': 1, 'replicate_size': 1, 'shard_size': 4}" in result.stderr


def test_fl_hsdp_mid_round_resume_restores_each_group_and_replica(tmp_path):
    """Inside a group the replicas hold the same shards, so each group's checkpoint de-duplicates them."""
    hsdp = {
        **BASE,
        "strategy": "fl_hsdp",
        "strategy_kwargs": {
            "num_groups": 2,
            "replicate_size": 2,
            "shard_size": 2,
            "sync_every": 4,
            "outer_optimizer": "nesterov",
            "auto_wrap": ["__main__.Block"],
        },
        "devices": 8,
        "num_samples": 64,  # 8 ranks × batch 4: 2 steps per epoch
    }
    full = _run({**hsdp, "max_steps": 8}, tmp_path / "full")
    _run({**hsdp, "max_steps": 6, "checkpoint_every": 6, "checkpoint_dir": str(tmp_path / "ckpt")}, tmp_path / "first")
    (step6,) = (tmp_path / "ckpt").glob("*step=6.ckpt")
    resumed = _run({**hsdp, "max_steps": 8, "resume_from": str(step6)}, tmp_path / "resumed")
    for a, b in zip(full, resumed, strict=True):
        assert b["losses"] == pytest.approx(a["losses"][6:], rel=1e-6, abs=1e-7)
        for name in a["final"]:
            torch.testing.assert_close(b["final"][name], a["final"][name], rtol=1e-6, atol=1e-7)
        assert [s["step"] for s in b["syncs"]] == [8]
