"""Save → load → continue reproduces the uninterrupted FL run, including the sync phase and DiLoCo state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_fedshard.strategies.group_checkpoint import load_meta
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


# the structure-aware inner optimizers (lightning_fedshard.optim), resumed mid-round like AdamW
STRUCTURED = ("muon", "adamw8bit")
# ModelCheckpoint's names for the saves at step 8 (right after a sync) and step 6 (mid-round), 2 steps per epoch
STEP8, STEP6 = "epoch=3-step=8.ckpt", "epoch=2-step=6.ckpt"
OTHER_MESH = {
    **BASE,
    "strategy": "fsdp2",
    "strategy_kwargs": {"auto_wrap": ["__main__.Block"], "outer_optimizer": "nesterov"},
    "max_steps": 12,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, object]:
    """One launch fits them in turn: the uninterrupted run, the first part (saving every 2 steps), the resumes
    from step 8 and step 6, and last a resume from step 8 under another mesh, which must fail the launch."""
    root = tmp_path_factory.mktemp("ckpt")
    ckpt_dir = root / "checkpoints"
    plans = {
        "uninterrupted": {**BASE, "max_steps": 12},
        "first_part": {**BASE, "max_steps": 8, "checkpoint_every": 2, "checkpoint_dir": str(ckpt_dir)},
        "resumed_after_sync": {**BASE, "max_steps": 12, "resume_from": str(ckpt_dir / STEP8)},
        "resumed_mid_round": {**BASE, "max_steps": 12, "resume_from": str(ckpt_dir / STEP6)},
        **{
            f"{optimizer}_{part}": {**BASE, "optimizer": optimizer, "max_steps": 12, **extra}
            for optimizer in STRUCTURED
            for part, extra in (
                ("uninterrupted", {"checkpoint_every": 6, "checkpoint_dir": str(root / optimizer)}),
                ("resumed_mid_round", {"resume_from": str(root / optimizer / STEP6)}),
            )
        },
        "other_mesh": {**OTHER_MESH, "resume_from": str(ckpt_dir / STEP8)},
    }
    result = launch({"devices": 4, "runs": [{**cfg, "out": str(root / name)} for name, cfg in plans.items()]}, root)
    results: dict[str, object] = {"other_mesh": result}
    for name in list(plans)[:-1]:
        assert (root / name / "rank3.pt").exists(), f"{name} did not finish:\n{result.stderr[-6000:]}"
        results[name] = load_ranks(root / name, 4)
    results["paths"] = {"step6": ckpt_dir / STEP6, "step8": ckpt_dir / STEP8}
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


@pytest.mark.parametrize("optimizer", STRUCTURED)
def test_muon_and_adamw8bit_resume_mid_round_as_the_uninterrupted_run(runs, optimizer):
    full, resumed = runs[f"{optimizer}_uninterrupted"], runs[f"{optimizer}_resumed_mid_round"]
    for rank, (a, b) in enumerate(zip(full, resumed, strict=True)):
        assert b["losses"] == pytest.approx(a["losses"][6:], rel=1e-6, abs=1e-7), f"rank {rank}"
        for name in a["final"]:
            torch.testing.assert_close(b["final"][name], a["final"][name], rtol=1e-6, atol=1e-7)
        # the 8-bit codes come back as int8/uint8 (torch's load_state_dict would have cast them to fp32)
        assert b["optimizer_state_dtypes"] == a["optimizer_state_dtypes"]
    if optimizer == "adamw8bit":
        assert {"exp_avg:torch.int8", "exp_avg_sq:torch.uint8"} <= set(full[0]["optimizer_state_dtypes"])
    else:
        assert "momentum_buffer:torch.float32" in full[0]["optimizer_state_dtypes"]


def test_mid_round_checkpoint_holds_diverged_groups(runs):
    """Between syncs the groups differ; their checkpoint must restore each group's own parameters."""
    first = runs["first_part"]
    step6 = [first[0]["params"][5], first[2]["params"][5]]
    assert any(not torch.equal(step6[0][n], step6[1][n]) for n in step6[0])
    resumed = runs["resumed_mid_round"]
    for rank, group_params in ((0, step6[0]), (2, step6[1])):
        assert all(torch.equal(resumed[rank]["initial"][n], group_params[n]) for n in group_params)


def test_resuming_with_another_mesh_fails_on_every_rank_with_the_layout(runs):
    result = runs["other_mesh"]
    assert result.returncode != 0
    assert "was saved with mesh {'num_groups': 2, 'replicate_size': 1, 'shard_size': 2}" in result.stderr
    assert "this run uses {'num_groups': 1, 'replicate_size': 1, 'shard_size': 4}" in result.stderr


# ~190 s of launches; CI keeps fl_hsdp's resume through the CLI (tests/training/test_cli_distributed.py) and
# fl_fsdp's mid-round resume here. With the benchmarks (-m slow), for CI's 20 minutes.
@pytest.mark.slow
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


# Two groups of one rank each: 2 ranks × batch 4 over 16 samples, 2 steps per epoch.
SMALL = {
    "strategy": "fl_fsdp",
    "strategy_kwargs": {"num_groups": 2, "sync_every": 4, "auto_wrap": ["__main__.Block"]},
    "devices": 2,
    "lr": 0.01,
    "optimizer": "adamw",
    "batch_size": 4,
    "num_samples": 16,
}


@pytest.fixture(scope="module")
def torn_saves(tmp_path_factory) -> dict[str, Path]:
    """Rank 1 is SIGKILLed while last.ckpt is rewritten; a resume from it is SIGKILLed in a save under a new name."""
    root = tmp_path_factory.mktemp("torn")
    first, second = root / "first" / "ckpt", root / "second" / "ckpt"
    # saves at step 2: epoch=0-step=2.ckpt, last.ckpt; at step 4: epoch=1-step=4.ckpt, then last.ckpt again (killed)
    killed = {**SMALL, "max_steps": 6, "checkpoint_every": 2, "checkpoint_dir": str(first), "save_last": True}
    result = launch({**killed, "kill_in_save": {"rank": 1, "save": 4}}, root / "first")
    assert result.returncode != 0, "the run was meant to be killed"
    resumed = {**SMALL, "max_steps": 4, "checkpoint_every": 2, "checkpoint_dir": str(second), "record_start": True}
    result = launch(
        {**resumed, "resume_from": str(first / "last.ckpt"), "kill_in_save": {"rank": 1, "save": 1}}, root / "second"
    )
    assert result.returncode != 0, "the run was meant to be killed"
    return {"first": first, "second": second, "second_out": root / "second"}


def _saved_params(checkpoint: Path, group: int) -> dict[str, torch.Tensor]:
    """The model of one group, read in this process with plain DCP (independent of the strategy's loader)."""
    folder = checkpoint / f"group{group}"
    metadata = dcp.FileSystemReader(folder).read_metadata()
    state = {
        "state_dict": {
            fqn.removeprefix("state_dict."): torch.zeros(md.size)
            for fqn, md in metadata.state_dict_metadata.items()
            if fqn.startswith("state_dict.")
        }
    }
    dcp.load(state, checkpoint_id=folder)
    return state["state_dict"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_rank_killed_while_last_ckpt_is_rewritten_leaves_the_previous_one_loadable(torn_saves):
    first = torn_saves["first"]
    (staging,) = first.glob(".last.ckpt.incomplete-*")
    saved = ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    assert sorted(p.name for p in first.iterdir() if p != staging) == saved
    assert load_meta(first / "last.ckpt")["fedshard"]["optimizer_steps"] == 2
    with pytest.raises(ValueError, match=r"is an incomplete checkpoint: the unfinished save of 'last.ckpt'"):
        load_meta(staging)
    # the resume loaded it: each group restarted from its own step-2 parameters
    for rank in (0, 1):
        start = torch.load(torn_saves["second_out"] / f"start_rank{rank}.pt", weights_only=True)
        assert start["optimizer_steps"] == 2
        step2 = _saved_params(first / "epoch=0-step=2.ckpt", group=rank)
        assert start["initial"].keys() == step2.keys()
        for name, value in step2.items():
            assert torch.equal(start["initial"][name], value), (rank, name)


def test_a_rank_killed_in_a_save_under_a_new_name_leaves_it_rejected_as_incomplete(torn_saves):
    second = torn_saves["second"]
    (staging,) = second.iterdir()
    assert staging.name.startswith(".epoch=1-step=4.ckpt.incomplete-")
    with pytest.raises(FileNotFoundError, match=r"step=4.ckpt' does not exist: its save was interrupted, so it is"):
        load_meta(second / "epoch=1-step=4.ckpt")
    with pytest.raises(ValueError, match=r"is an incomplete checkpoint: the unfinished save of 'epoch=1-step=4.ckpt'"):
        load_meta(staging)


def test_a_non_finite_shard_is_refused_on_every_rank_before_fedavg_spreads_it(tmp_path):
    poison = {"rank": 1, "step": 2, "param": "net.1.linear.weight"}
    cfg = {**SMALL, "strategy_kwargs": {**SMALL["strategy_kwargs"], "sync_every": 2}, "max_steps": 4, "poison": poison}
    result = launch(cfg, tmp_path)
    assert result.returncode != 0
    refused = [torch.load(tmp_path / f"refused_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert refused[0]["error"] == refused[1]["error"]
    assert (
        "federation group 1 (rank 1): the parameter 'net.1.linear.weight' holds non-finite values"
        in refused[0]["error"]
    )
    assert "FedAvg refused, nothing was sent or written back" in result.stderr
    assert not torch.isfinite(refused[1]["pre"]["net.1.linear.weight"]).all()
    # group 0 kept its own finite parameters; group 1 kept its NaN (nothing averaged was written back)
    for name, value in refused[0]["pre"].items():
        assert torch.isfinite(value).all() and torch.equal(refused[0]["post"][name], value), name
    for name, value in refused[1]["pre"].items():
        torch.testing.assert_close(refused[1]["post"][name], value, rtol=0, atol=0, equal_nan=True)
