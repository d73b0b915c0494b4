"""Mesh arithmetic of FedShardDims, without any process group."""

import pytest

from lightning_fedshard import FedShardDims


@pytest.mark.parametrize(
    ("world", "per_node", "given", "expected"),
    [
        (4, 2, {}, (2, 1, 2)),  # fl_fsdp defaults: S = devices per node, F = the rest
        (4, 4, {"num_groups": 1, "replicate_size": 1}, (1, 1, 4)),  # fsdp2
        (8, 2, {"num_groups": 1}, (1, 4, 2)),  # hsdp: R takes the rest
        (8, 2, {"default_replicate_size": 2}, (2, 2, 2)),  # fl_hsdp defaults
        (8, 8, {"num_groups": 2, "replicate_size": 2}, (2, 2, 2)),  # S takes the rest
        (512, 4, {"num_groups": 128, "replicate_size": 1}, (128, 1, 4)),  # paper FL+FSDP
        (512, 4, {"num_groups": 16}, (16, 8, 4)),  # paper FL+HSDP
    ],
)
def test_resolve_fills_missing_sizes(world, per_node, given, expected):
    dims = FedShardDims.resolve(world, per_node, **given)
    assert (dims.num_groups, dims.replicate_size, dims.shard_size) == expected
    assert dims.world_size == world
    assert dims.group_size == expected[1] * expected[2]


def test_resolve_rejects_sizes_that_do_not_multiply_to_the_world():
    with pytest.raises(ValueError, match=r"2 × 1 × 3 = 6 does not fit the 8 processes"):
        FedShardDims.resolve(8, 4, num_groups=2, replicate_size=1, shard_size=3)


def test_resolve_rejects_a_world_the_other_sizes_do_not_divide():
    with pytest.raises(ValueError, match="world size 6 is not divisible by the product 4"):
        FedShardDims.resolve(6, 4)


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="must be a positive integer"):
        FedShardDims(bad, 1, 1)
