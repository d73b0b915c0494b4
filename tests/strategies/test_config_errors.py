"""Bad configurations fail with a clear message when the Trainer is built, before any process starts."""

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

from lightning_fedshard import STRATEGY_NAMES, FLFSDPStrategy, FLHSDPStrategy, register_strategies


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
    with pytest.raises(ValueError, match="`sync_dtype='int8'` is not a floating-point"):
        FLHSDPStrategy(sync_dtype="int8")


def test_fl_hsdp_needs_two_replicas():
    with pytest.raises(ValueError, match="`replicate_size` must be an integer ≥ 2, got 1"):
        FLHSDPStrategy(replicate_size=1)
    # derived from the world: one node of 4 devices leaves one replica
    with pytest.raises(ValueError, match="`replicate_size` must be an integer ≥ 2, got 1"):
        build(FLHSDPStrategy(num_groups=1))


def test_auto_wrap_must_name_a_module_class():
    with pytest.raises(ValueError, match="cannot import the `auto_wrap` class 'no.such.Block'"):
        FLFSDPStrategy(auto_wrap=["no.such.Block"])
    with pytest.raises(ValueError, match="is not an nn.Module class"):
        FLFSDPStrategy(auto_wrap=["collections.OrderedDict"])


def test_names_are_registered_once_and_resolve_to_the_strategies():
    register_strategies()  # a second registration is a no-op, not an error
    for name in STRATEGY_NAMES:
        assert name in StrategyRegistry
    trainer = build("fl_fsdp")
    assert type(trainer.strategy) is FLFSDPStrategy
    assert (trainer.strategy.dims.num_groups, trainer.strategy.dims.shard_size) == (1, 4)
    fsdp2 = build("fsdp2").strategy
    assert (fsdp2.dims.num_groups, fsdp2.dims.replicate_size, fsdp2.dims.shard_size) == (1, 1, 4)
    hsdp = build("hsdp", devices=2, num_nodes=2).strategy
    assert (hsdp.dims.num_groups, hsdp.dims.replicate_size, hsdp.dims.shard_size) == (1, 2, 2)
    fl_hsdp = build("fl_hsdp", devices=2, num_nodes=4).strategy
    assert (fl_hsdp.dims.num_groups, fl_hsdp.dims.replicate_size, fl_hsdp.dims.shard_size) == (2, 2, 2)
