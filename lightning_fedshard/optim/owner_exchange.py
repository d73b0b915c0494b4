"""Whole-matrix work on sharded matrices: each matrix is gathered on its owner rank, transformed once there and
scattered back as shards, every owner working on its own matrices at the same time.

Two ``all_to_all_single`` per process group and step, whatever the number of matrices: the first sends each
rank's shard of every matrix to that matrix's owner, the second returns each rank's shard of the results. This is
the owner-based scheme of veScale-FSDP's and torchtitan's distributed Muon, on FSDP2's ``Shard(d)`` storage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_fedshard.optim.shard_plan import chunk_sizes

__all__ = ["ShardLayout", "local_shard", "transform_on_owners"]


def local_shard(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor (a view: in-place changes reach the DTensor); a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class ShardLayout:
    """How a (possibly sharded) tensor is split: ``Shard(dim)`` over ``world`` ranks of ``group``, this rank being
    ``rank``; a plain tensor, or a DTensor that is only replicated, is one shard (``group=None``)."""

    shape: tuple[int, ...]
    dim: int = 0
    group: dist.ProcessGroup | None = None
    rank: int = 0
    world: int = 1

    @classmethod
    def of(cls, tensor: Tensor) -> ShardLayout:
        shape = tuple(tensor.shape)
        if not isinstance(tensor, DTensor):
            return cls(shape)
        sharded = [(mesh_dim, p) for mesh_dim, p in enumerate(tensor.placements) if p.is_shard()]
        if any(not (p.is_shard() or p.is_replicate()) for p in tensor.placements):
            raise ValueError(f"A tensor with placements {tensor.placements} is neither sharded nor replicated.")
        if not sharded:
            return cls(shape)
        if len(sharded) > 1:
            raise ValueError(
                f"A tensor sharded over {len(sharded)} mesh dimensions {tensor.placements}: whole-matrix work needs"
                " shards along one mesh dimension (FSDP2, HSDP and the FL strategies shard along one)."
            )
        mesh_dim, placement = sharded[0]
        mesh = tensor.device_mesh
        return cls(shape, placement.dim, mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.dim] = chunk_sizes(self.shape[self.dim], self.world)[rank]
        return tuple(shape)

    def local_numel(self, rank: int) -> int:
        return math.prod(self.local_shape(rank))

    def split(self, whole: Tensor) -> tuple[Tensor, ...]:
        """Every rank's shard of ``whole``."""
        return whole.split(chunk_sizes(self.shape[self.dim], self.world), dim=self.dim)


def transform_on_owners(
    shards: Sequence[Tensor],
    layouts: Sequence[ShardLayout],
    owners: Sequence[int],
    transform: Callable[[int, Tensor], Tensor],
) -> list[int]:
    """Replaces every ``shards[j]`` (this rank's shard of matrix ``j``) in place with its shard of
    ``transform(j, whole_j)``, computed once, on rank ``owners[j]`` of the layouts' common group.

    Every rank of the group calls this with the same matrices in the same order. Returns the indices ``j`` this
    rank transformed. Example (one process, no group: every matrix is whole and local)::

        done = transform_on_owners([u], [ShardLayout.of(u)], [0], lambda j, m: newton_schulz(m))  # [0]
    """
    groups = {id(layout.group) for layout in layouts}
    if len(groups) > 1:
        raise ValueError("transform_on_owners takes matrices of one process group; call it once per group.")
    if not layouts or layouts[0].group is None:
        for j, shard in enumerate(shards):
            shard.copy_(transform(j, shard))
        return list(range(len(shards)))
    group, me, world = layouts[0].group, layouts[0].rank, layouts[0].world
    mine = [j for j, owner in enumerate(owners) if owner == me]
    to_owner = [[shards[j].reshape(-1) for j in range(len(shards)) if owners[j] == dest] for dest in range(world)]
    send_sizes = [sum(t.numel() for t in parts) for parts in to_owner]
    recv_sizes = [sum(layouts[j].local_numel(src) for j in mine) for src in range(world)]
    received = _all_to_all(_concat(to_owner, shards[0]), send_sizes, recv_sizes, group).split(recv_sizes)

    offsets = [0] * world
    results = []
    for j in mine:
        pieces = []
        for src in range(world):
            n = layouts[j].local_numel(src)
            pieces.append(received[src][offsets[src] : offsets[src] + n].view(layouts[j].local_shape(src)))
            offsets[src] += n
        results.append(layouts[j].split(transform(j, torch.cat(pieces, dim=layouts[j].dim))))
    back = [[result[dest].reshape(-1) for result in results] for dest in range(world)]
    returned = _all_to_all(_concat(back, shards[0]), recv_sizes, send_sizes, group).split(send_sizes)

    offsets = [0] * world
    for j, shard in enumerate(shards):
        owner, n = owners[j], shard.numel()
        shard.copy_(returned[owner][offsets[owner] : offsets[owner] + n].view_as(shard))
        offsets[owner] += n
    return mine


def _concat(parts: list[list[Tensor]], like: Tensor) -> Tensor:
    flat = [t for per_rank in parts for t in per_rank]
    return torch.cat(flat) if flat else like.new_empty(0)


def _all_to_all(send: Tensor, send_sizes: list[int], recv_sizes: list[int], group: dist.ProcessGroup) -> Tensor:
    received = send.new_empty(sum(recv_sizes))
    dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=group)
    return received
