"""Streaming sync (streaming DiLoCo fragments) on real gloo processes, against blocking sync and hand updates."""

from __future__ import annotations

import pytest
import torch

from lightning_fedshard.strategies import FLFSDPStrategy, FLHSDPStrategy
from tests.strategies.conftest import share_launch
from tests.strategies.test_fl_training import FL_FSDP, fl_fsdp, mean_params, param_bytes

pytestmark = pytest.mark.multiproc

STREAMING_LIKE_BLOCKING = {
    **FL_FSDP,
    "strategy_kwargs": fl_fsdp(sync_every=3, sync_schedule="streaming", fragments=1, fragment_sync_delay=0),
}
OUTER_LR, MOMENTUM, ALPHA = 0.7, 0.9, 0.5


def streaming_diloco(**kwargs) -> dict:
    """2 fragments mixed half-and-half with the local shards when applied; DiLoCo's outer step per fragment."""
    return fl_fsdp(outer_optimizer="nesterov", sync_schedule="streaming", fragments=2, fragment_update_alpha=ALPHA,
                   **kwargs)  # fmt: skip


# each fragment sent one step before it is applied
STREAMING_DILOCO = {
    **FL_FSDP,
    "strategy_kwargs": streaming_diloco(sync_every=4, fragment_sync_delay=1),
    "max_steps": 8,
    "val_check_interval": 3,  # a no-grad forward while fragment 1's average is in flight
}
share_launch(STREAMING_LIKE_BLOCKING, STREAMING_DILOCO)
GROUP_LEADS = (0, 2)  # rank 0 of each group: it records the full parameters of its group


def test_streaming_with_one_fragment_and_no_delay_is_blocking_sync_bit_for_bit(run_worker):
    blocking, streaming = run_worker(FL_FSDP), run_worker(STREAMING_LIKE_BLOCKING)
    for b, s in zip(blocking, streaming, strict=True):
        assert b["losses"] == s["losses"]
        for step, (pb, ps) in enumerate(zip(b["params"], s["params"], strict=True), start=1):
            assert all(torch.equal(pb[n], ps[n]) for n in pb), f"step {step}"
        assert all(torch.equal(b["final"][n], s["final"][n]) for n in b["final"])
        assert [x["comm/fed_bytes"] for x in b["ledger_steps"]] == [x["comm/fed_bytes"] for x in s["ledger_steps"]]
        assert s["fragment_bytes"] == b["fragment_bytes"]
        assert s["fragment_bytes"][0] == pytest.approx(b["ledger_mean"]["fed"] * len(b["ledger_steps"]))
        assert s["syncs_count"] == b["syncs_count"] == 3


def test_streaming_diloco_averages_every_parameter_once_per_round_by_the_delayed_mixed_rule(run_worker):
    ranks = run_worker(STREAMING_DILOCO)
    fragments = ranks[0]["fragments"]
    names = list(ranks[0]["initial"])
    # the fragments partition the model, in module order
    assert len(fragments) == 2 and [n for f in fragments for n in f] == names
    records = [ranks[r]["syncs"] for r in GROUP_LEADS]
    assert [(x["step"], x["started"], x["finished"]) for x in records[0]] == [
        (1, 0, None), (2, None, 0), (3, 1, None), (4, None, 1),
        (5, 0, None), (6, None, 0), (7, 1, None), (8, None, 1),
    ]  # fmt: skip
    # every parameter is averaged (its fragment applied) exactly once in each round of 4 steps
    for round_start in (1, 5):
        applied = [n for x in records[0][round_start - 1 : round_start + 3] if x["finished"] is not None
                   for n in fragments[x["finished"]]]  # fmt: skip
        assert sorted(applied) == sorted(names)

    # hand-written streaming DiLoCo: pseudo-gradient when sent, Nesterov step per fragment and mix when applied
    global_params = dict(ranks[0]["initial"])
    buffers = {n: torch.zeros_like(t) for n, t in global_params.items()}
    pseudo_grads: dict[str, torch.Tensor] = {}
    for k in range(len(records[0])):
        pre = [r[k]["pre"] for r in records]
        sent, applied = records[0][k]["started"], records[0][k]["finished"]
        if sent is not None:
            local = mean_params(pre)
            pseudo_grads = {n: global_params[n] - local[n] for n in fragments[sent]}
        expected = [dict(p) for p in pre]  # what is not applied now stays as the inner step left it
        if applied is not None:
            for n in fragments[applied]:
                buffers[n] = MOMENTUM * buffers[n] + pseudo_grads[n]
                global_params[n] = global_params[n] - OUTER_LR * (pseudo_grads[n] + MOMENTUM * buffers[n])
                for e, p in zip(expected, pre, strict=True):
                    e[n] = ALPHA * p[n] + (1 - ALPHA) * global_params[n]
        for group, record in enumerate(records):
            post = record[k]["post"]
            for n in names:
                where = f"group {group}, step {k + 1}, {n}"
                torch.testing.assert_close(
                    post[n], expected[group][n], rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}"
                )
            if applied is None:  # sending changes nothing
                assert all(torch.equal(post[n], pre[group][n]) for n in names)
    # the fit ends with every group holding the same parameters
    for record in ranks[1:]:
        assert all(torch.equal(record["final"][n], ranks[0]["final"][n]) for n in names)


def test_streaming_rounds_send_the_blocking_rounds_fed_bytes_counted_per_fragment(run_worker):
    ranks = run_worker(STREAMING_DILOCO)
    group = (0, 1)  # the shard ranks of group 0 hold the model between them once
    fragments = ranks[0]["fragments"]
    sizes = {n: t.numel() * t.element_size() for n, t in ranks[0]["initial"].items()}
    for round_start in (1, 5):
        steps = range(round_start, round_start + 4)
        sent = sum(ranks[r]["ledger_steps"][s - 1]["comm/fed_bytes"] for r in group for s in steps)
        assert sent == param_bytes(ranks[0])  # a blocking round: every rank's slice once, 2·(F-1)/F = 1×
    for f, members in enumerate(fragments):
        per_round = sum(ranks[r]["fragment_bytes"][f] for r in group) / 2
        assert per_round == sum(sizes[n] for n in members)
        # its bytes go out in the step it is sent, not in the step it is applied
        assert all(ranks[0]["ledger_steps"][s - 1][f"comm/fed_fragment{f}_bytes"] > 0 for s in (1 + 2 * f, 5 + 2 * f))
        assert all(ranks[0]["ledger_steps"][s - 1][f"comm/fed_fragment{f}_bytes"] == 0 for s in (2 + 2 * f, 6 + 2 * f))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sync_schedule": "stream"}, "unknown `sync_schedule='stream'`"),
        ({"fragments": 2}, "apply to sync_schedule='streaming'"),
        ({"sync_schedule": "streaming", "sync_every": 8, "fragments": 3}, "must be divisible by `fragments=3`"),
        ({"sync_schedule": "streaming", "sync_every": 8, "fragments": 4, "fragment_sync_delay": 2}, r"\[0, 2\)"),
        ({"sync_schedule": "streaming", "fragments": 0}, "`fragments` must be an integer ≥ 1"),
        ({"sync_schedule": "streaming", "fragment_update_alpha": float("nan")}, "`fragment_update_alpha`"),
        ({"sync_schedule": "streaming", "fragment_update_alpha": -0.1}, "in \\[0, 1\\]"),
    ],
)
def test_bad_streaming_settings_fail_at_construction(kwargs, message):
    for cls in (FLFSDPStrategy, FLHSDPStrategy):
        with pytest.raises(ValueError, match=message):
            cls(**kwargs)


# 4 ranks × batch 4 over 32 samples: 2 steps per epoch, so the checkpoint at step 6 falls on an epoch boundary.
# Fragment 1 is sent after step 6 and applied after step 8: the checkpoint holds its average in flight.
STREAMING_RESUME = {
    **FL_FSDP,
    "strategy_kwargs": streaming_diloco(sync_every=8, fragment_sync_delay=2),
    "num_samples": 32,
    "limit_val_batches": 0,
    "max_steps": 10,
}


@pytest.mark.slow  # three launches: the uninterrupted run, the first part, the resumed part
def test_a_checkpoint_with_an_average_in_flight_resumes_to_the_uninterrupted_run(tmp_path):
    from lightning_fedshard.strategies.group_checkpoint import load_meta
    from tests.strategies.conftest import launch, load_ranks

    def run(cfg: dict, name: str) -> list[dict]:
        result = launch(cfg, tmp_path / name)
        assert result.returncode == 0, result.stderr[-6000:]
        return load_ranks(tmp_path / name, cfg["devices"])

    ckpt_dir = tmp_path / "checkpoints"
    full = run(STREAMING_RESUME, "full")
    run({**STREAMING_RESUME, "max_steps": 6, "checkpoint_every": 6, "checkpoint_dir": str(ckpt_dir)}, "first")
    (step6,) = ckpt_dir.glob("*step=6.ckpt")
    assert load_meta(step6)["fedshard"]["in_flight_fragment"] == 1
    resumed = run({**STREAMING_RESUME, "resume_from": str(step6)}, "resumed")
    for a, b in zip(full, resumed, strict=True):
        assert b["losses"] == pytest.approx(a["losses"][6:], rel=1e-6, abs=1e-7)
        for name in a["final"]:
            torch.testing.assert_close(b["final"][name], a["final"][name], rtol=1e-6, atol=1e-7)
        assert [x["step"] for x in b["syncs"]] == [s for s in (8, 10) if s > 6]
