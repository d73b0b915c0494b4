"""The block-aligned shard planner against torch.chunk's actual splits, for random shapes and shard counts."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

from lightning_fedshard.models import Llama, LlamaConfig
from lightning_fedshard.optim import BlockShardPlan, chunk_sizes, plan_param


def chunk_starts(tensor: torch.Tensor, world: int) -> list[int]:
    """Flat start offsets of torch.chunk's non-empty pieces of ``tensor`` along dim 0 (the independent split)."""
    sizes = [piece.numel() for piece in torch.chunk(tensor, world)]
    return [sum(sizes[:r]) for r in range(len(sizes))]


def test_chunk_sizes_are_torch_chunks_split():
    for n in range(0, 40):
        for world in range(1, 9):
            pieces = [len(c) for c in torch.chunk(torch.empty(n), world)] if n else []
            assert chunk_sizes(n, world) == pieces + [0] * (world - len(pieces))


@pytest.mark.parametrize("seed", range(2))
def test_every_shard_starts_on_a_block_boundary_and_padding_stays_below_the_bound(seed):
    rng = random.Random(seed)
    for _ in range(150):
        shape = tuple(rng.choice([1, 2, 3, 5, 8, 12, 64, 96, 100, 128, 257, 384]) for _ in range(rng.randint(1, 3)))
        if math.prod(shape) > 50_000:
            shape = shape[:1]
        world = rng.randint(1, 16)
        block = rng.choice([32, 128, 256])
        plan = plan_param("p", shape, world, block)
        n, row = shape[plan.dim], plan.row
        assert plan.dim == 0 or n % world == 0  # FSDP2 refuses uneven shards on dim > 0
        canonical = torch.arange(math.prod(shape)).reshape(shape).movedim(plan.dim, 0)
        # the aligned layout: dim padded to slices_per_rank × world slices, then torch.chunk
        padded = torch.nn.functional.pad(canonical.reshape(n, -1), (0, 0, 0, plan.slices_per_rank * world - n))
        starts = chunk_starts(padded.reshape(-1), world) if plan.slices_per_rank < n else [0]
        assert all(s % block == 0 for s in starts), (shape, world, block, plan)
        assert plan.aligned_padding == padded.numel() - canonical.numel()
        assert 0 <= plan.aligned_padding < plan.padding_bound() or plan.aligned_padding == 0
        if plan.fsdp_aligned:  # FSDP2's own chunks (no padding added by us) already start on blocks
            assert plan.slices_per_rank == math.ceil(n / world)
            rows = [len(c) for c in torch.chunk(canonical, world)]
            assert all((sum(rows[:r]) * row) % block == 0 for r in range(len(rows)))
        assert plan.fsdp_padding == (math.ceil(shape[0] / world) * world - shape[0]) * (math.prod(shape) // shape[0])


def test_the_plan_shards_on_dim_1_where_only_dim_1_aligns():
    # 4 × 6 on 3 ranks, blocks of 8: dim 0 gives shards of 2 rows × 6 = 12 (not aligned); dim 1 gives 4 × 2 = 8
    plan = BlockShardPlan.for_module(nn.Linear(6, 4, bias=False), world=3, block=8)
    assert (plan.params[0].dim, plan.params[0].fsdp_aligned) == (1, True)
    assert plan.placement_fn(nn.Parameter(torch.empty(4, 6))) == Shard(1)


def test_llama_8b_at_512_shards_only_its_norms_need_more_padding():
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("llama3.1-8b"))
    plan = BlockShardPlan.for_module(model, world=512, block=256)
    assert {p.name.rsplit(".", 2)[-2] for p in plan.unaligned} <= {"attention_norm", "ffn_norm", "norm"}
    assert len(plan.unaligned) == 2 * 32 + 1
    # each 4096-element norm needs 512 ranks × 256 = 131,072 elements
    assert {p.aligned_padding for p in plan.unaligned} == {512 * 256 - 4096}
    assert "total: 291 parameters" in plan.report()


@pytest.mark.parametrize("bad", [0, -256, True, 2.5, "256"])
def test_strategies_take_a_positive_integer_shard_block(bad):
    from lightning_fedshard import FLFSDPStrategy, FLHSDPStrategy

    assert FLFSDPStrategy(shard_block=256).shard_block == 256 and FLHSDPStrategy().shard_block is None
    with pytest.raises(ValueError, match="shard_block"):
        FLHSDPStrategy(shard_block=bad)
