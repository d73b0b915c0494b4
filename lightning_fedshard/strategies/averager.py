"""The cross-group step of FL+FSDP / FL+HSDP: average the local parameter shards of every federation group."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from lightning_fedshard.dynamiq.settings import Compression
from lightning_fedshard.dynamiq.telemetry import CompressionStats
from lightning_fedshard.strategies.ledger import CommLedger

__all__ = ["OUTER_OPTIMIZERS", "SYNC_MODES", "FedAverager", "FedTransport", "ProcessGroupTransport"]

OUTER_OPTIMIZERS = ("avg", "nesterov")
SYNC_MODES = ("all_replicas", "leader")

BUCKET_BYTES = 64 * 1024 * 1024
_MAX_REPORTED = 6  # tensors named when a sync is refused


class FedTransport(Protocol):
    """How a rank's buckets reach the same slice in the other groups: the mesh's ``fed`` process group, or a
    torchft Manager (:class:`~lightning_fedshard.strategies.fault_tolerance.ManagerTransport`)."""

    def size(self) -> int:
        """The groups averaged in this round."""
        ...

    def all_reduce_mean_(self, flat: torch.Tensor) -> None:
        """``flat`` becomes its mean across those groups."""
        ...


class ProcessGroupTransport:
    """The fixed ``fed`` process group of one job's device mesh."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def all_reduce_mean_(self, flat: torch.Tensor) -> None:
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group)


class FedAverager:
    """Averages sharded parameters across federation groups, optionally through a DiLoCo outer optimizer.

    Every rank holds the local shards of its FSDP parameters; the rank at the same (replicate, shard)
    position in every group holds the same slice, so one all-reduce over the ``fed`` group per bucket
    averages the whole model without any rank ever holding a full parameter.

    * ``outer_optimizer="avg"``: FedAvg, the local shards become the mean across groups.
    * ``outer_optimizer="nesterov"``: DiLoCo. The pseudo-gradient ``global - local`` is averaged, then
      SGD with Nesterov momentum steps the global copy, which every group then adopts.

    With ``sync_mode="leader"`` only replica 0 of each group joins the fed all-reduce and broadcasts the
    result to its replicas, which cuts cross-group traffic by the replicate size.

    ``transport`` replaces the ``fed`` group's all-reduce (fault tolerance: a torchft Manager, whose divisor is
    the groups present in the round).

    With ``compression`` the fed all-reduce is a compressed ring, and FedAvg averages the change since
    the last sync (``reference - local``, as DiLoCo does) rather than the weights themselves: the
    codec's relative error then scales with a few steps' updates, not with the weights.

    Example::

        averager = FedAverager(model.named_parameters(), fed_group=mesh.get_group("fed"),
                               replicate_group=mesh.get_group("replicate"), ledger=CommLedger())
        averager.sync()  # after resharding every FSDP module
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        *,
        fed_group: ProcessGroup,
        replicate_group: ProcessGroup,
        ledger: CommLedger,
        outer_optimizer: Literal["avg", "nesterov"] = "avg",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        sync_dtype: torch.dtype = torch.float32,
        sync_mode: Literal["all_replicas", "leader"] = "all_replicas",
        compression: Compression | None = None,
        transport: FedTransport | None = None,
    ) -> None:
        if transport is not None and compression is not None:
            raise ValueError(
                "FedAverager: DynamiQ's compressed ring runs over the fixed `fed` process group; with fault tolerance"
                " (a torchft transport) average uncompressed (see docs/fault_tolerance.md)."
            )
        self.named_params = list(named_params)
        self._fed_group = fed_group
        self._transport: FedTransport = transport or ProcessGroupTransport(fed_group)
        self._replicate_group = replicate_group
        self._ledger = ledger
        self._sync_dtype = sync_dtype
        self._leader_broadcast = sync_mode == "leader" and dist.get_world_size(replicate_group) > 1
        self.outer_optimizer = outer_optimizer
        self.compression = compression
        self.stats = CompressionStats()
        self._codec = compression.make_codec() if compression is not None else None
        self._reference: list[torch.Tensor] = []
        self._outer: torch.optim.SGD | None = None
        if outer_optimizer == "nesterov" or compression is not None:
            self._reference = [p.to_local().detach().to(sync_dtype, copy=True) for _, p in self.named_params]
        if self._codec is not None:
            # compile the codec's kernels for this run's bucket sizes now, not inside the first sync
            local = [p.to_local() for _, p in self.named_params]
            for bucket in _buckets(local, BUCKET_BYTES // sync_dtype.itemsize):
                numel = sum(t.numel() for t in bucket)
                compression.warm_up(self._codec, numel, dist.get_world_size(fed_group), local[0].device)
        if outer_optimizer == "nesterov":
            self._outer = torch.optim.SGD(self._reference, lr=outer_lr, momentum=outer_momentum, nesterov=True)
            # A zero buffer makes the first step identical to SGD's lazy init and gives the checkpoint a fixed layout.
            for ref in self._reference:
                self._outer.state[ref]["momentum_buffer"] = torch.zeros_like(ref)

    @torch.no_grad()
    def sync(self) -> None:
        """Runs one cross-group round. Every FSDP module must be resharded first."""
        local_shards = [p.to_local() for _, p in self.named_params]
        if not self._reference:
            self._refuse_unsafe_average(local_shards, "parameter")
            self._mean_across_groups_(local_shards)
            return
        pseudo_grads = [
            ref - local.to(self._sync_dtype) for ref, local in zip(self._reference, local_shards, strict=True)
        ]
        self._refuse_unsafe_average(pseudo_grads, "change since the last sync of")
        self._mean_across_groups_(pseudo_grads)
        if self._outer is None:
            for ref, grad in zip(self._reference, pseudo_grads, strict=True):
                ref.sub_(grad)
        else:
            for ref, grad in zip(self._reference, pseudo_grads, strict=True):
                ref.grad = grad
            self._outer.step()
            self._outer.zero_grad(set_to_none=True)
        for local, ref in zip(local_shards, self._reference, strict=True):
            local.copy_(ref)

    def _refuse_unsafe_average(self, contributions: list[torch.Tensor], what: str) -> None:
        """Raises on every rank, before anything is sent or written back, when a contribution is not finite or so
        large that the sum across groups would overflow ``sync_dtype``: its average would poison every group.

        One flag all-reduced over the world keeps the ranks together (a rank that raised alone would leave the
        others waiting in the next collective); the names are gathered only when a rank flagged one.
        """
        num_groups = self._transport.size()
        limit = torch.finfo(self._sync_dtype).max / num_groups
        peaks = torch.stack(
            [
                torch.linalg.vector_norm(t.detach(), ord=float("inf"), dtype=torch.float32)
                if t.numel()
                else t.new_zeros((), dtype=torch.float32)
                for t in contributions
            ]
        )
        unsafe = ~(peaks <= limit)  # NaN compares false
        flag = unsafe.any().to(torch.int32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        group, rank = dist.get_rank(self._fed_group), dist.get_rank()
        found = [
            f"federation group {group} (rank {rank}): the {what} {name!r} "
            + (
                "holds non-finite values (NaN or inf)"
                if not torch.isfinite(peak)
                else f"holds values up to {peak.item():.3g}, too large to average over {num_groups} groups in"
                f" {self._sync_dtype}"
            )
            for (name, _), peak, bad in zip(self.named_params, peaks.cpu(), unsafe.cpu(), strict=True)
            if bad
        ]
        reports: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(reports, found)
        lines = list(dict.fromkeys(line for lines in reports for line in lines))
        shown = "; ".join(lines[:_MAX_REPORTED]) + (
            f"; and {len(lines) - _MAX_REPORTED} more" if lines[_MAX_REPORTED:] else ""
        )
        raise FloatingPointError(
            "FedAvg refused, nothing was sent or written back; averaging would spread these values to every group: "
            + shown
        )

    def _mean_across_groups_(self, tensors: list[torch.Tensor]) -> None:
        for bucket in _buckets(tensors, BUCKET_BYTES // self._sync_dtype.itemsize):
            flat = torch.cat([t.reshape(-1).to(self._sync_dtype) for t in bucket])
            self._all_reduce_mean_(flat)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def _all_reduce_mean_(self, flat: torch.Tensor) -> None:
        nbytes = flat.numel() * flat.element_size()
        is_leader = not self._leader_broadcast or dist.get_rank(self._replicate_group) == 0
        if is_leader and self.compression is not None:
            sent_before = self.stats.wire_bytes
            self.compression.all_reduce(flat, self._codec, self._fed_group, self.stats)
            flat.div_(dist.get_world_size(self._fed_group))
            self._ledger.record_sent("fed", self.stats.wire_bytes - sent_before)
        elif is_leader:
            self._transport.all_reduce_mean_(flat)
            self._ledger.record("fed", "all_reduce", nbytes, self._transport.size())
        if self._leader_broadcast:
            dist.broadcast(flat, group=self._replicate_group, group_src=0)
            self._ledger.record("replicate", "broadcast", nbytes, dist.get_world_size(self._replicate_group))

    def state_dict(self) -> dict[str, dict[str, DTensor]]:
        """The global parameters of the last sync (and the outer optimizer's momentum), as DTensors sharded
        like the parameters, so a distributed checkpoint keeps every rank's slice."""
        if not self._reference:
            return {}
        state: dict[str, dict[str, DTensor]] = {"reference": {}}
        for (name, p), ref in zip(self.named_params, self._reference, strict=True):
            state["reference"][name] = _like(p, ref)
        if self._outer is not None:
            state["momentum"] = {
                name: _like(p, self._outer.state[ref]["momentum_buffer"])
                for (name, p), ref in zip(self.named_params, self._reference, strict=True)
            }
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, dict[str, DTensor]]) -> None:
        if not self._reference:
            return
        for (name, _), ref in zip(self.named_params, self._reference, strict=True):
            ref.copy_(state["reference"][name].to_local())
            if self._outer is not None:
                self._outer.state[ref]["momentum_buffer"].copy_(state["momentum"][name].to_local())


def _like(param: DTensor, local: torch.Tensor) -> DTensor:
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _buckets(tensors: list[torch.Tensor], max_numel: int) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    numel = 0
    for t in tensors:
        if bucket and numel + t.numel() > max_numel:
            yield bucket
            bucket, numel = [], 0
        bucket.append(t)
        numel += t.numel()
    if bucket:
        yield bucket
