"""The cross-group step of FL+FSDP / FL+HSDP: average the local parameter shards of every federation group."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from lightning_fedshard.dynamiq.codec import Codec
from lightning_fedshard.dynamiq.settings import Compression
from lightning_fedshard.dynamiq.telemetry import CompressionStats
from lightning_fedshard.strategies.ledger import CommLedger

__all__ = [
    "OUTER_OPTIMIZERS",
    "SYNC_MODES",
    "FedAverager",
    "FedTransport",
    "PendingAverage",
    "ProcessGroupTransport",
    "master_dtype",
]

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

    def start_mean_(self, flat: torch.Tensor) -> dist.Work:
        """Starts turning ``flat`` into its mean across those groups, in place; the work to wait for."""
        ...

    def start_compressed_mean_(
        self, flat: torch.Tensor, compression: Compression, codec: Codec, stats: CompressionStats
    ) -> dist.Work | None:
        """The same through DynamiQ's ``codec``; the work to wait for, or None when the mean is done."""
        ...


class ProcessGroupTransport:
    """The fixed ``fed`` process group of one job's device mesh."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def start_mean_(self, flat: torch.Tensor) -> dist.Work:
        return dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group, async_op=True)

    def start_compressed_mean_(
        self, flat: torch.Tensor, compression: Compression, codec: Codec, stats: CompressionStats
    ) -> None:
        """DynamiQ's compressed ring over the group, in the calling thread."""
        compression.all_reduce(flat, codec, self.group, stats)
        flat.div_(self.size())


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

    ``sync_dtype`` is the dtype on the wire only. The global copy (``reference``), DiLoCo's momentum and the
    mixing into the local shards stay in fp32, or in the parameters' or ``sync_dtype``'s dtype where that is
    wider (:func:`master_dtype`): rounding them to a bf16 wire every round would erase every outer update below
    2^-8 of a weight. So when ``sync_dtype`` is narrower than a parameter, FedAvg too keeps a global copy and
    averages the change since the last sync: the wire then rounds a few steps' updates, not the weights.

    Example::

        averager = FedAverager(model.named_parameters(), fed_group=mesh.get_group("fed"),
                               replicate_group=mesh.get_group("replicate"), ledger=CommLedger())
        averager.sync()  # after resharding every FSDP module

    ``fragments`` splits the parameters (indices into ``named_params``) for streaming sync: :meth:`start` sends one
    fragment's average without waiting for it, :meth:`finish` applies it later; :meth:`sync` does both for every
    fragment in turn. The outer optimizer steps only the fragment being finished (its other references hold no
    gradient), so each fragment's momentum sees only its own pseudo-gradients.
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
        fragments: Sequence[Sequence[int]] | None = None,
        transport: FedTransport | None = None,
    ) -> None:
        self.named_params = list(named_params)
        everything = [list(range(len(self.named_params)))]
        self.fragments = [list(f) for f in fragments] if fragments is not None else everything
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
        narrow_wire = any(torch.promote_types(p.dtype, sync_dtype) != sync_dtype for _, p in self.named_params)
        if outer_optimizer == "nesterov" or compression is not None or narrow_wire:
            self._reference = [
                p.to_local().detach().to(master_dtype(p.dtype, sync_dtype), copy=True) for _, p in self.named_params
            ]
        if self._codec is not None:
            # build the codec's kernels now, not inside the first sync
            local = [p.to_local() for _, p in self.named_params]
            for fragment in self.fragments:
                for bucket in _buckets([local[i] for i in fragment], BUCKET_BYTES // sync_dtype.itemsize):
                    numel = sum(t.numel() for t in bucket)
                    compression.warm_up(self._codec, numel, dist.get_world_size(fed_group), local[0].device)
        if outer_optimizer == "nesterov":
            self._outer = torch.optim.SGD(self._reference, lr=outer_lr, momentum=outer_momentum, nesterov=True)
            # A zero buffer makes the first step identical to SGD's lazy init and gives the checkpoint a fixed layout.
            for ref in self._reference:
                self._outer.state[ref]["momentum_buffer"] = torch.zeros_like(ref)

    @torch.no_grad()
    def sync(self) -> None:
        """Runs one cross-group round, every fragment at once. Every FSDP module must be resharded first."""
        for fragment in range(len(self.fragments)):
            self.finish(self.start(fragment))

    @torch.no_grad()
    def start(self, fragment: int) -> PendingAverage:
        """Sends ``fragment``'s contribution (its local shards, or with a reference their change since the last sync)
        into the cross-group average and returns without waiting for it (DynamiQ's compressed ring, which runs in
        the calling thread, completes here). Every FSDP module must be resharded first."""
        indices = self.fragments[fragment]
        local = [self.named_params[i][1].to_local() for i in indices]
        if self._reference:
            contributions, peaks = [], []
            for i, t in zip(indices, local, strict=True):
                change = self._reference[i] - t  # in the global copy's dtype, checked before the wire rounds it
                peaks.append(_peak(change))
                contributions.append(change.to(self._sync_dtype))
            what = "change since the last sync of"
        else:
            contributions, peaks, what = local, [_peak(t) for t in local], "parameter"
        self._refuse_unsafe_average(torch.stack(peaks), what, indices)
        pending = PendingAverage(fragment, indices)
        for bucket in _buckets(list(range(len(indices))), BUCKET_BYTES // self._sync_dtype.itemsize, contributions):
            flat = torch.cat([contributions[j].reshape(-1).to(self._sync_dtype) for j in bucket])
            pending.buckets.append((bucket, flat, self._start_mean(flat, fragment)))
        return pending

    @torch.no_grad()
    def finish(self, pending: PendingAverage, alpha: float = 0.0) -> None:
        """Waits for ``pending`` and applies it: the fragment's global copy becomes the average (FedAvg) or takes the
        outer step on the averaged pseudo-gradient (DiLoCo), and each local shard becomes
        ``alpha · local + (1 - alpha) · global`` (``alpha = 0``: the global copy exactly). The average arrives in
        ``sync_dtype``; the global copy, the momentum and the mixing take it in their own (wider) dtype."""
        self.complete(pending)
        indices = pending.indices
        local = [self.named_params[i][1].to_local() for i in indices]
        averaged = pending.unflatten(local)
        if not self._reference:
            for t, mean in zip(local, averaged, strict=True):
                _mix_(t, mean, alpha)
            return
        refs = [self._reference[i] for i in indices]
        if self._outer is None:
            for ref, grad in zip(refs, averaged, strict=True):
                ref.sub_(grad)
        else:
            for ref, grad in zip(refs, averaged, strict=True):
                ref.grad = grad.to(ref.dtype)
            self._outer.step()  # steps only the references that hold a gradient: this fragment's
            self._outer.zero_grad(set_to_none=True)
        for t, ref in zip(local, refs, strict=True):
            _mix_(t, ref, alpha)

    def complete(self, pending: PendingAverage) -> None:
        """Waits for ``pending``'s all-reduces (and in ``leader`` mode broadcasts the result inside the group), so
        that its buffers hold the average; applies nothing. Idempotent."""
        if pending.complete:
            return
        for _, flat, work in pending.buckets:
            if work is not None:
                work.wait()
            if self._leader_broadcast:
                dist.broadcast(flat, group=self._replicate_group, group_src=0)
                self._ledger.record("replicate", "broadcast", _nbytes(flat), dist.get_world_size(self._replicate_group))
        pending.complete = True

    def _refuse_unsafe_average(self, peaks: torch.Tensor, what: str, indices: list[int]) -> None:
        """Raises on every rank, before anything is sent or written back, when a contribution (its largest magnitude
        in ``peaks``, fp64) is not finite or so large that the sum across groups would overflow ``sync_dtype``: its
        average would poison every group.

        One flag all-reduced over the world keeps the ranks together (a rank that raised alone would leave the
        others waiting in the next collective); the names are gathered only when a rank flagged one.
        """
        num_groups = self._transport.size()
        limit = torch.finfo(self._sync_dtype).max / num_groups
        unsafe = ~(peaks <= limit)  # NaN compares false
        flag = unsafe.any().to(torch.int32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        group, rank = dist.get_rank(self._fed_group), dist.get_rank()
        names = [self.named_params[i][0] for i in indices]
        found = [
            f"federation group {group} (rank {rank}): the {what} {name!r} "
            + (
                "holds non-finite values (NaN or inf)"
                if not torch.isfinite(peak)
                else f"holds values up to {peak.item():.3g}, too large to average over {num_groups} groups in"
                f" {self._sync_dtype}"
            )
            for name, peak, bad in zip(names, peaks.cpu(), unsafe.cpu(), strict=True)
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

    def empty_buffer(self, indices: list[int]) -> torch.Tensor:
        """A flat buffer in ``sync_dtype`` for the local shards of ``indices`` (to load a saved average into)."""
        numel = sum(self.named_params[i][1].to_local().numel() for i in indices)
        return torch.zeros(numel, dtype=self._sync_dtype, device=self.named_params[indices[0]][1].device)

    def _start_mean(self, flat: torch.Tensor, fragment: int) -> dist.Work | None:
        """Starts averaging ``flat`` across groups in place (on the leader only in ``leader`` mode); the work to
        wait for, or None when nothing is left in flight."""
        if self._leader_broadcast and dist.get_rank(self._replicate_group) != 0:
            return None
        if self.compression is not None:
            sent_before = self.stats.wire_bytes
            work = self._transport.start_compressed_mean_(flat, self.compression, self._codec, self.stats)
            self._ledger.record_sent("fed", self.stats.wire_bytes - sent_before, fragment)
            return work
        self._ledger.record("fed", "all_reduce", _nbytes(flat), self._transport.size(), fragment)
        return self._transport.start_mean_(flat)

    def state_dict(self) -> dict[str, dict[str, DTensor]]:
        """The global parameters of the last sync (and the outer optimizer's momentum), as DTensors sharded
        like the parameters, so a distributed checkpoint keeps every rank's slice."""
        if not self._reference:
            return {}
        state: dict[str, dict[str, DTensor]] = {"reference": {}}
        for (name, p), ref in zip(self.named_params, self._reference, strict=True):
            state["reference"][name] = like_param(p, ref)
        if self._outer is not None:
            state["momentum"] = {
                name: like_param(p, self._outer.state[ref]["momentum_buffer"])
                for (name, p), ref in zip(self.named_params, self._reference, strict=True)
            }
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, dict[str, DTensor]]) -> None:
        """Copies a saved global copy and momentum in, upcast to this averager's dtype (a checkpoint written when
        they were kept in ``sync_dtype``, e.g. bf16, loads into the fp32 state)."""
        if not self._reference:
            return
        for (name, _), ref in zip(self.named_params, self._reference, strict=True):
            ref.copy_(state["reference"][name].to_local())
            if self._outer is not None:
                self._outer.state[ref]["momentum_buffer"].copy_(state["momentum"][name].to_local())


@dataclass
class PendingAverage:
    """One fragment's cross-group average on its way: flat buckets (positions into ``indices``, the buffer,
    the backend's work or None), returned by :meth:`FedAverager.start` and applied by :meth:`FedAverager.finish`."""

    fragment: int
    indices: list[int]
    buckets: list[tuple[list[int], torch.Tensor, dist.Work | None]] = field(default_factory=list)
    complete: bool = False

    def unflatten(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """The averaged values, one view per tensor, shaped like ``like`` (one tensor per index, in order)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(self.indices)
        for bucket, flat, _ in self.buckets:
            offset = 0
            for j in bucket:
                out[j] = flat[offset : offset + like[j].numel()].view_as(like[j])
                offset += like[j].numel()
        return out


def master_dtype(param_dtype: torch.dtype, sync_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's global copy and outer momentum: fp32, or the parameter's or the wire's dtype
    where wider. Never the wire's alone: a bf16 global copy would round away every outer step below 2^-8 relative."""
    return torch.promote_types(torch.promote_types(param_dtype, torch.float32), sync_dtype)


def _mix_(local: torch.Tensor, target: torch.Tensor, alpha: float) -> None:
    """``local = alpha · local + (1 - alpha) · target``, exactly ``target`` for ``alpha = 0``; the blend runs in
    fp32 at least (a bf16 blend would round the local weights before they are stored)."""
    if alpha == 0:
        local.copy_(target)
    else:
        dtype = master_dtype(local.dtype, target.dtype)
        local.copy_(torch.lerp(local.to(dtype), target.to(dtype), 1 - alpha))


def _peak(tensor: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in ``tensor`` (NaN if it holds one), in fp64 so that no dtype's range clips it."""
    if not tensor.numel():
        return tensor.new_zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(tensor.detach(), ord=float("inf")).to(torch.float64)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def like_param(param: DTensor, local: torch.Tensor) -> DTensor:
    """``local`` (shaped like ``param``'s local shard) as a DTensor sharded like ``param``."""
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _buckets(items: list, max_numel: int, tensors: list[torch.Tensor] | None = None) -> Iterator[list]:
    """Consecutive runs of ``items`` of at most ``max_numel`` elements each (a larger tensor alone); the sizes are
    those of ``tensors`` (the items themselves when not given)."""
    sizes = [t.numel() for t in (items if tensors is None else tensors)]
    bucket: list = []
    numel = 0
    for item, size in zip(items, sizes, strict=True):
        if bucket and numel + size > max_numel:
            yield bucket
            bucket, numel = [], 0
        bucket.append(item)
        numel += size
    if bucket:
        yield bucket
