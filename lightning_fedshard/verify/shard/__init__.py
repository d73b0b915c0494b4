"""Sharded bound propagation: FSDP weights, tensor-parallel rows and Megatron zones, domain-parallel
branch-and-bound, and the lockstep rule that keeps the ranks' collectives matched."""

from lightning_fedshard.verify.shard.lockstep import lockstep
from lightning_fedshard.verify.shard.rows import RowPartition

__all__ = ["RowPartition", "lockstep"]
