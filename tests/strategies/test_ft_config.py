"""FaultTolerance settings: read from the arguments or the environment, and refused with a clear error before any
process starts."""

from __future__ import annotations

from datetime import timedelta

import pytest
from lightning.pytorch import Trainer

from lightning_fedshard.strategies import FLFSDPStrategy, FLHSDPStrategy
from lightning_fedshard.strategies.fault_tolerance import FaultTolerance


def test_fields_left_out_come_from_the_environment():
    env = {
        "TORCHFT_LIGHTHOUSE": "http://head:29510",
        "REPLICA_GROUP_ID": "3",
        "NUM_REPLICA_GROUPS": "4",
        "TORCHFT_MIN_GROUPS": "2",
        "TORCHFT_QUORUM_TIMEOUT_SEC": "90",
    }
    ft = FaultTolerance(timeout=timedelta(seconds=5)).resolve(env)
    assert (ft.lighthouse, ft.group_id, ft.num_groups, ft.min_groups) == ("http://head:29510", 3, 4, 2)
    assert ft.timeout == timedelta(seconds=5)
    assert ft.quorum_timeout == timedelta(seconds=90)
    assert ft.connect_timeout == timedelta(seconds=60)  # the default
    assert ft.replica_id == "fedgroup_3"  # torchft numbers ranks by the id's trailing digits
    given = FaultTolerance(lighthouse="http://other:1", group_id=0, num_groups=2, min_groups=1).resolve(env)
    assert (given.lighthouse, given.group_id, given.num_groups, given.min_groups) == ("http://other:1", 0, 2, 1)
    # torchft's own variables override a given timeout inside torchft: the resolved value says which is in force
    assert FaultTolerance(quorum_timeout=timedelta(hours=1)).resolve(env).quorum_timeout == timedelta(seconds=90)


@pytest.mark.parametrize(
    ("ft", "env", "message"),
    [
        (FaultTolerance(group_id=0), {}, "no Lighthouse address; pass lighthouse="),
        (
            FaultTolerance(lighthouse="http://h:1"),
            {},
            "no federation group id; pass group_id=<k> or set REPLICA_GROUP_ID",
        ),
        (
            FaultTolerance(lighthouse="http://h:1"),
            {"REPLICA_GROUP_ID": "one"},
            "REPLICA_GROUP_ID='one' is not an integer",
        ),
        (FaultTolerance(lighthouse="http://h:1", group_id=-1), {}, "`group_id` must be an integer ≥ 0, got -1"),
        (FaultTolerance(lighthouse="http://h:1", group_id=0), {}, "no federation size; pass num_groups=<F> or set"),
        (FaultTolerance(lighthouse="http://h:1", group_id=2, num_groups=2), {}, "`group_id`=2 must be below"),
        (FaultTolerance(lighthouse="http://h:1", group_id=0, num_groups=0), {}, "`num_groups` must be an integer ≥ 1"),
        (
            FaultTolerance(lighthouse="http://h:1", group_id=0, num_groups=2, min_groups=3),
            {},
            "`min_groups`=3 is more than `num_groups`=2",
        ),
        (
            FaultTolerance(lighthouse="http://h:1", group_id=0, num_groups=2, min_groups=0),
            {},
            "`min_groups` must be an integer ≥ 1",
        ),
        (
            FaultTolerance(lighthouse="http://h:1", group_id=0, num_groups=1),
            {"TORCHFT_TIMEOUT_SEC": "-1"},
            "TORCHFT_TIMEOUT_SEC='-1' must be a positive number of seconds",
        ),
        (
            FaultTolerance(lighthouse="http://h:1", group_id=0, num_groups=1, timeout=timedelta(0)),
            {},
            "`timeout` must be a positive duration",
        ),
        (
            FaultTolerance(lighthouse="http://h:1", group_id=0, num_groups=1, heal_transport="disk"),
            {},
            "`heal_transport` must be one of 'stream', 'http', got 'disk'",
        ),
    ],
)
def test_bad_settings_name_the_problem(ft, env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("?", r"\?")):
        ft.resolve(env)


def test_a_job_is_one_group():
    with pytest.raises(ValueError, match="each federation group is a job of its own, so `num_groups`"):
        FLHSDPStrategy(num_groups=2, fault_tolerance=FaultTolerance())
    with pytest.raises(TypeError, match="`fault_tolerance` must be a FaultTolerance or None"):
        FLFSDPStrategy(fault_tolerance={"lighthouse": "http://h:1"})
    # streaming sync runs each fragment's average as a torchft round of its own (docs/fault_tolerance.md)
    streaming = FLFSDPStrategy(sync_every=4, sync_schedule="streaming", fragments=2, fault_tolerance=FaultTolerance())
    assert streaming.fault_tolerance is not None and streaming.options.schedule.fragments == 2
    # one group over the job's world: the layout that elsewhere needs two groups fits two devices
    assert FLFSDPStrategy(fault_tolerance=FaultTolerance()).layout(1, 2).num_groups == 1


def test_a_missing_lighthouse_fails_before_any_process_starts(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    strategy = FLFSDPStrategy(fault_tolerance=FaultTolerance(group_id=0))
    with pytest.raises(ValueError, match="no Lighthouse address"):
        Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
