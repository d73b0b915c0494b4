"""Mesh arithmetic of FedShardDims, without any process group."""

import itertools

import pytest

from lightning_fedshard import FedShardDims

FL_HSDP = {"min_groups": 2, "min_replicas": 2}  # what FLHSDPStrategy asks of the sizes it derives
FL_FSDP = {"min_groups": 2, "replicate_size": 1}


@pytest.mark.parametrize(
    ("world", "per_node", "given", "expected"),
    [
        (4, 2, {}, (2, 1, 2)),  # S = devices per node, F = the rest
        (4, 4, {"num_groups": 1, "replicate_size": 1}, (1, 1, 4)),  # fsdp2
        (8, 2, {"num_groups": 1}, (1, 4, 2)),  # hsdp: R takes the rest
        (8, 2, FL_HSDP, (2, 2, 2)),  # fl_hsdp on 4 nodes of 2
        (8, 8, {"num_groups": 2, "replicate_size": 2}, (2, 2, 2)),  # S takes the rest
        (512, 4, {"num_groups": 128, "replicate_size": 1}, (128, 1, 4)),  # paper FL+FSDP
        (512, 4, {"num_groups": 16}, (16, 8, 4)),  # paper FL+HSDP
        (6, 4, {}, (3, 1, 2)),  # 4 devices per node do not divide 6: the largest shard that divides both
        (8, 4, {"num_groups": 1, "replicate_size": 1}, (1, 1, 8)),  # fsdp2 over two nodes: S must span them
    ],
)
def test_resolve_fills_missing_sizes(world, per_node, given, expected):
    dims = FedShardDims.resolve(world, per_node, **given)
    assert (dims.num_groups, dims.replicate_size, dims.shard_size) == expected
    assert dims.world_size == world
    assert dims.group_size == expected[1] * expected[2]


@pytest.mark.parametrize(
    ("devices", "promised", "expected"),
    [
        (4, FL_HSDP, (2, 2, 1)),
        (8, FL_HSDP, (2, 2, 2)),
        (16, FL_HSDP, (2, 2, 4)),
        (6, FL_HSDP, (3, 2, 1)),  # the fewest replicas
        (4, {"num_groups": 1, "min_replicas": 2}, (1, 2, 2)),  # hsdp
        (8, {"num_groups": 1, "min_replicas": 2}, (1, 2, 4)),
        (2, {"num_groups": 1, "min_replicas": 2}, (1, 2, 1)),
        (4, FL_FSDP, (2, 1, 2)),
        (8, FL_FSDP, (2, 1, 4)),
    ],
)
def test_one_node_gets_every_promised_dimension_and_the_largest_shard(devices, promised, expected):
    dims = FedShardDims.resolve(devices, devices, **promised)
    assert (dims.num_groups, dims.replicate_size, dims.shard_size) == expected
    # an independent check by enumeration: no layout with the promised dimensions shards over more ranks
    fits = [
        (f, r, s)
        for f, r, s in itertools.product(range(1, devices + 1), repeat=3)
        if f * r * s == devices
        and f >= promised.get("min_groups", 1)
        and promised.get("num_groups", f) == f
        and r >= promised.get("min_replicas", 1)
        and promised.get("replicate_size", r) == r
    ]
    assert max(s for _, _, s in fits) == dims.shard_size


def test_given_sizes_are_kept_even_where_the_defaults_would_differ():
    dims = FedShardDims.resolve(8, 8, num_groups=4, **{k: v for k, v in FL_HSDP.items() if k != "min_groups"})
    assert (dims.num_groups, dims.replicate_size, dims.shard_size) == (4, 2, 1)
    dims = FedShardDims.resolve(8, 8, shard_size=1, min_groups=2, min_replicas=2)
    assert (dims.num_groups, dims.replicate_size, dims.shard_size) == (4, 2, 1)  # the fewest replicas


def test_resolve_rejects_sizes_that_do_not_multiply_to_the_world():
    with pytest.raises(ValueError, match=r"2 × 1 × 3 = 6 does not fit the 8 processes"):
        FedShardDims.resolve(8, 4, num_groups=2, replicate_size=1, shard_size=3)


def test_resolve_rejects_a_world_the_given_sizes_do_not_divide():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by the product 4 of the given sizes \(shard"):
        FedShardDims.resolve(6, 4, shard_size=4)


def test_resolve_rejects_a_world_without_room_for_the_promised_dimensions():
    with pytest.raises(ValueError, match=r"Cannot lay out 2 processes .* num_groups=≥ 2, replicate_size=≥ 2"):
        FedShardDims.resolve(2, 2, **FL_HSDP)
    with pytest.raises(ValueError, match=r"Cannot lay out 4 processes .* replicate_size=≥ 2, shard_size=2"):
        FedShardDims.resolve(4, 4, shard_size=2, **FL_HSDP)


def test_describe_names_the_layout():
    assert FedShardDims(2, 2, 1).describe() == "2 groups × 2 replicas × 1 shard"
    assert FedShardDims(1, 1, 4).describe() == "1 group × 1 replica × 4 shards"


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="must be a positive integer"):
        FedShardDims(bad, 1, 1)
