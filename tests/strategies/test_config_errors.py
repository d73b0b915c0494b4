"""Bad configurations fail with a clear message when the Trainer is built, before any process starts."""

import logging
import math
from datetime import timedelta

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from lightning_fedshard import STRATEGY_NAMES, DynamiQDDPStrategy, FLFSDPStrategy, FLHSDPStrategy, register_strategies


@pytest.fixture
def lightning_log():
    """Messages Lightning's rank-zero helpers log (its logger does not propagate to pytest's caplog)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


def build(strategy, devices=4, num_nodes=1):
    return Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, logger=False)


def test_world_not_divisible_by_the_groups():
    with pytest.raises(ValueError, match="world size 4 is not divisible by the product 3"):
        build(FLFSDPStrategy(num_groups=3))


def test_mesh_that_does_not_fit_nodes_times_devices():
    with pytest.raises(ValueError, match=r"2 × 2 × 2 = 8 does not fit the 4 processes"):
        build(FLHSDPStrategy(num_groups=2, replicate_size=2, shard_size=2))
    with pytest.raises(ValueError, match=r"2 × 2 × 2 = 8 does not fit the 12 processes"):
        build(FLHSDPStrategy(num_groups=2, replicate_size=2, shard_size=2), devices=4, num_nodes=3)


@pytest.mark.parametrize("sync_every", [0, -3, 2.5])
def test_sync_every_below_one(sync_every):
    with pytest.raises(ValueError, match="`sync_every` must be an integer ≥ 1"):
        FLFSDPStrategy(sync_every=sync_every)


def test_unknown_outer_optimizer():
    with pytest.raises(ValueError, match=r"unknown `outer_optimizer='adam'`"):
        FLHSDPStrategy(outer_optimizer="adam")


def test_unknown_sync_mode_and_dtype():
    with pytest.raises(ValueError, match="unknown `sync_mode='some'`"):
        FLHSDPStrategy(sync_mode="some")
    with pytest.raises(ValueError, match="`sync_dtype='int8'` is not a dtype the average can run in"):
        FLHSDPStrategy(sync_dtype="int8")


def test_fl_hsdp_needs_two_replicas():
    with pytest.raises(ValueError, match="`replicate_size` must be an integer ≥ 2, got 1"):
        FLHSDPStrategy(replicate_size=1)
    # a given shard size of one node of 4 devices leaves one replica
    with pytest.raises(ValueError, match=r"on 1 node\(s\) × 4 device\(s\): Cannot lay out 4 processes .* shard_size=4"):
        build(FLHSDPStrategy(num_groups=1, shard_size=4))
    with pytest.raises(ValueError, match=r"at least two replicas per group; FLFSDPStrategy \(strategy='fl_fsdp'\)"):
        build(FLHSDPStrategy(num_groups=2, shard_size=2))


def test_auto_wrap_must_name_module_classes():
    with pytest.raises(ValueError, match="cannot import the `auto_wrap` class 'no.such.Block'"):
        FLFSDPStrategy(auto_wrap=["no.such.Block"])
    with pytest.raises(TypeError, match="`auto_wrap` entry 'collections.OrderedDict' is not an nn.Module class"):
        FLFSDPStrategy(auto_wrap=["collections.OrderedDict"])
    # a bare string is one path, not a list of one-letter paths ("cannot import class 't'")
    with pytest.raises(
        TypeError, match=r"`auto_wrap` takes a list .* got the single 'pkg.Block'; write \['pkg.Block'\]"
    ):
        FLFSDPStrategy(auto_wrap="pkg.Block")
    with pytest.raises(TypeError, match=r"`activation_checkpointing` takes a list .* write \[<class"):
        FLHSDPStrategy(activation_checkpointing=nn.Linear)
    with pytest.raises(ValueError, match="cannot import the `activation_checkpointing` class 'no.Such'"):
        FLHSDPStrategy(activation_checkpointing=["no.Such"])


@pytest.mark.parametrize("outer_lr", [0, -0.5, math.nan, math.inf, "0.7", True])
def test_outer_lr_must_be_a_finite_positive_number(outer_lr):
    with pytest.raises(ValueError, match=r"`outer_lr` must be a finite number > 0, got"):
        FLHSDPStrategy(outer_lr=outer_lr)


@pytest.mark.parametrize("outer_momentum", [1, 1.5, -0.1, math.nan])
def test_outer_momentum_must_be_below_one(outer_momentum):
    with pytest.raises(ValueError, match=r"`outer_momentum` must be a number in \[0, 1\), got"):
        FLFSDPStrategy(outer_momentum=outer_momentum)


@pytest.mark.parametrize("strategy", [FLHSDPStrategy, FLFSDPStrategy, DynamiQDDPStrategy])
def test_timeout_must_be_a_positive_duration(strategy):
    for bad in (timedelta(seconds=-30), timedelta(0)):
        with pytest.raises(ValueError, match=r"`timeout` must be a positive duration, got"):
            strategy(timeout=bad)
    with pytest.raises(TypeError, match=r"`timeout` must be a datetime.timedelta"):
        strategy(timeout=30)
    # the form a YAML config holds (str(timedelta)) is read, and checked the same way
    assert strategy(timeout="0:00:30")._timeout == timedelta(seconds=30)
    with pytest.raises(ValueError, match=r"`timeout` must be a positive duration, got -1 day, 23:59:30"):
        strategy(timeout="-1 day, 23:59:30")
    with pytest.raises(ValueError, match=r"`timeout='30s'` is not a duration like '0:00:30'"):
        strategy(timeout="30s")


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", torch.float8_e5m2, torch.int32, "nonsense"])
def test_sync_dtype_must_be_one_the_average_runs_in(dtype):
    with pytest.raises(ValueError, match=r"is not a dtype the average can run in; use one of 'float16', 'bfloat16'"):
        FLHSDPStrategy(sync_dtype=dtype)
    assert FLHSDPStrategy(sync_dtype=torch.bfloat16).options.sync_dtype is torch.bfloat16


def test_booleans_are_not_sizes_or_step_counts():
    with pytest.raises(ValueError, match="`sync_every` must be an integer ≥ 1"):
        FLFSDPStrategy(sync_every=True)
    with pytest.raises(ValueError, match="`num_groups` must be a positive integer or None, got True"):
        FLFSDPStrategy(num_groups=True)
    with pytest.raises(ValueError, match="`replicate_size` must be an integer ≥ 2, got True"):
        FLHSDPStrategy(replicate_size=True)


def test_names_are_registered_once_and_resolve_to_the_strategies():
    register_strategies()  # a second registration is a no-op, not an error
    for name in STRATEGY_NAMES:
        assert name in StrategyRegistry
    assert type(build("fl_fsdp").strategy) is FLFSDPStrategy
    assert type(build("hsdp").strategy) is FLHSDPStrategy
    assert type(build("ddp_dynamiq").strategy) is DynamiQDDPStrategy


def layout(strategy) -> tuple[int, int, int]:
    dims = strategy.dims
    return dims.num_groups, dims.replicate_size, dims.shard_size


@pytest.mark.parametrize(
    ("name", "devices", "num_nodes", "expected"),
    [
        # one node: every dimension the name promises, the rest of the node sharded
        ("fl_hsdp", 4, 1, (2, 2, 1)),
        ("fl_hsdp", 8, 1, (2, 2, 2)),
        ("hsdp", 4, 1, (1, 2, 2)),
        ("hsdp", 8, 1, (1, 2, 4)),
        ("fl_fsdp", 4, 1, (2, 1, 2)),
        ("fsdp2", 4, 1, (1, 1, 4)),
        # several nodes: shards stay inside a node
        ("hsdp", 2, 2, (1, 2, 2)),
        ("fl_hsdp", 2, 4, (2, 2, 2)),
        ("fl_fsdp", 4, 2, (2, 1, 4)),
        ("fsdp2", 4, 2, (1, 1, 8)),
    ],
)
def test_names_get_a_layout_that_fits_the_world(name, devices, num_nodes, expected, lightning_log):
    assert layout(build(name, devices=devices, num_nodes=num_nodes).strategy) == expected
    f, r, s = expected
    announced = [m for m in lightning_log if m.startswith(("FLHSDPStrategy:", "FLFSDPStrategy:"))]
    assert len(announced) == 1 and f"{f} group" in announced[0] and f"{r} replica" in announced[0]
    assert f"{s} shard" in announced[0] and f"over {num_nodes} node(s) × {devices} device(s)" in announced[0]


def test_given_sizes_stay_authoritative_and_are_not_announced(lightning_log):
    assert layout(build(FLHSDPStrategy(num_groups=1, replicate_size=4, shard_size=1)).strategy) == (1, 4, 1)
    assert layout(build(FLFSDPStrategy(num_groups=4, shard_size=1)).strategy) == (4, 1, 1)
    assert not [m for m in lightning_log if "derived from the world" in m]
    # a partial choice is kept and the rest derived around it
    assert layout(build(FLHSDPStrategy(num_groups=2), devices=8).strategy) == (2, 2, 2)
    assert layout(build(FLHSDPStrategy(replicate_size=4), devices=8).strategy) == (2, 4, 1)


@pytest.mark.parametrize("name", ["fl_hsdp", "fl_fsdp"])
def test_a_world_too_small_for_the_name_is_rejected_before_launch(name):
    with pytest.raises(ValueError, match=r"on 1 node\(s\) × 1 device\(s\): Cannot lay out 1 processes"):
        build(name, devices=1)
