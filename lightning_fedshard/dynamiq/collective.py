"""Compressed ring and butterfly collectives built from point-to-point sends.

Reduce-scatter: every hop decodes the partial sum it receives, adds its own chunk in fp32 and
re-encodes it (the codec's ``accumulate``); after ``P-1`` hops rank ``r`` holds the exact fp32 sum of
chunk ``r`` plus the quantisation error of the hops. All-gather: the owner encodes its sum once and
the bytes travel unchanged, every rank (owner included) decoding the same bytes, so all ranks end
bit-identical, as data parallelism requires.

The butterfly variant (recursive halving, then recursive doubling) needs ``log2 P`` steps instead of
``P-1`` and carries sums of ``2^k`` chunks at step ``k``.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_fedshard.dynamiq.codec import (
    Codec,
    Message,
    Transfer,
    make_codec,
    non_finite_flag,
    raise_if_any_non_finite,
)
from lightning_fedshard.dynamiq.telemetry import CompressionStats

__all__ = [
    "DEFAULT_MIN_NUMEL",
    "TOPOLOGIES",
    "all_reduce",
    "loopback_all_reduce",
    "needs_host_staging",
    "plan_transfer",
    "reduce_scatter",
    "simulate_all_reduce",
    "warm_up",
]

TOPOLOGIES = ("ring", "butterfly")
#: Below this many coordinates a collective is latency-bound: 2(P-1) small messages lose to one all-reduce.
DEFAULT_MIN_NUMEL = 65536

Topology = Literal["ring", "butterfly"]
_P2P = Callable[[Tensor, Tensor, int, int], None]

# torch 2.13 renamed the tensor-in/tensor-out collectives and deprecated the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def plan_transfer(topology: str, world_size: int, chunk_numel: int, numel: int, *, all_gather: bool) -> Transfer:
    """The messages one rank sends, in order, for a collective over ``world_size`` padded chunks."""
    _check_topology(topology, world_size)
    p = world_size
    if topology == "ring":
        messages = [Message(chunk_numel, hop) for hop in range(1, p)]
    else:  # step k of recursive halving sends p / 2^(k+1) chunks holding 2^k summands each
        messages = [Message(chunk_numel, 1 << k) for k in range(p.bit_length() - 1) for _ in range(p >> (k + 1))]
    if all_gather:  # both topologies forward the P-1 finished chunks this rank does not own
        messages += [Message(chunk_numel, p)] * (p - 1)
    fraction = (2 if all_gather else 1) * (p - 1) / p
    return Transfer(world_size=p, messages=tuple(messages), reference_coords=fraction * numel)


def all_reduce(
    tensor: Tensor,
    *,
    codec: str | Codec = "dynamiq",
    bits: float = 5.0,
    group: ProcessGroup | None = None,
    topology: Topology = "ring",
    min_numel: int = DEFAULT_MIN_NUMEL,
    stats: CompressionStats | None = None,
    debug: bool = False,
) -> Tensor:
    """Sums ``tensor`` across ``group`` in place through a compressed multi-hop all-reduce and returns it.

    Every rank ends with the same bits. ``codec`` is a registered codec name (``"dynamiq"``,
    ``"bf16"``, ``"mxfp8"``, ``"thc"``, ...; see ``CODECS``) or a ``Codec`` instance (keep one to
    carry state such as stochastic-rounding seeds across calls). ``bits`` is the wire budget per
    coordinate for rate-adaptive codecs. Tensors under ``min_numel`` coordinates, empty ones, integer and
    bool tensors, and groups of one use a plain (exact) ``dist.all_reduce``; a complex tensor is compressed
    as its real and imaginary parts. NaN or Inf on any rank raises the same ``ValueError`` on every rank,
    before anything is sent. With ``debug=True`` an exact all-reduce of a copy measures the error into
    ``stats``.

    Example::

        grad = torch.randn(1 << 20)
        all_reduce(grad, codec="dynamiq", bits=5.0)   # now the sum over all ranks, identical everywhere
    """
    if tensor.is_complex():
        all_reduce(
            torch.view_as_real(tensor),
            codec=codec,
            bits=bits,
            group=group,
            topology=topology,
            min_numel=min_numel,
            stats=stats,
            debug=debug,
        )
        return tensor
    world_size = dist.get_world_size(group)
    reference = _exact_sum(tensor, group) if debug else None
    if _exact(tensor, world_size, min_numel):
        dist.all_reduce(tensor, group=group)
        _record_plain(stats, tensor, world_size, factor=2)
    else:
        ring = _Ring.over(make_codec(codec, bits), group, topology)
        chunks = _chunks(tensor, world_size, ring.codec.block)
        _agree_finite(ring.codec, chunks, group)
        transfer = plan_transfer(topology, world_size, chunks.shape[1], tensor.numel(), all_gather=True)
        with _finite_sums_agreed(ring.codec):
            summed = ring.codec.finish(ring.all_reduce(ring.codec.prepare(chunks, transfer, group)))
        tensor.copy_(summed.reshape(-1)[: tensor.numel()].view_as(tensor))
        _record(stats, ring, tensor.numel(), transfer, rechunked=chunks.data_ptr() != tensor.data_ptr())
    if reference is not None and stats is not None:
        stats.record_error(_squared_distance(tensor, reference), float(reference.double().square().sum()))
    return tensor


def reduce_scatter(
    output: Tensor,
    input: Tensor,
    *,
    codec: str | Codec = "dynamiq",
    bits: float = 5.0,
    group: ProcessGroup | None = None,
    topology: Topology = "ring",
    min_numel: int = DEFAULT_MIN_NUMEL,
    stats: CompressionStats | None = None,
) -> Tensor:
    """``output`` (on rank ``r``) becomes the sum over ``group`` of chunk ``r`` of ``input``, which holds
    ``world_size`` equal chunks; the compressed counterpart of ``dist.reduce_scatter_tensor`` with SUM. Takes
    the exact path, and treats complex and non-finite tensors, as ``all_reduce`` does."""
    world_size = dist.get_world_size(group)
    if input.numel() != world_size * output.numel():
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, expected {world_size} × output ({output.numel()})."
        )
    if input.is_complex():
        reduce_scatter(
            torch.view_as_real(output),
            torch.view_as_real(input),
            codec=codec,
            bits=bits,
            group=group,
            topology=topology,
            min_numel=min_numel,
            stats=stats,
        )
        return output
    if _exact(input, world_size, min_numel):
        _reduce_scatter_single(output, input, group=group)
        _record_plain(stats, input, world_size, factor=1)
        return output
    ring = _Ring.over(make_codec(codec, bits), group, topology)
    n = output.numel()
    chunks = _as_chunks(input, world_size, n, ring.codec.block)
    _agree_finite(ring.codec, chunks, group)
    transfer = plan_transfer(topology, world_size, chunks.shape[1], input.numel(), all_gather=False)
    with _finite_sums_agreed(ring.codec):
        owned = ring.codec.finish(ring.reduce_scatter(ring.codec.prepare(chunks, transfer, group))[None])[0]
    output.copy_(owned[:n].view_as(output))
    _record(stats, ring, input.numel(), transfer, rechunked=chunks.data_ptr() != input.data_ptr())
    return output


def simulate_all_reduce(
    inputs: list[Tensor], *, codec: str | Codec = "dynamiq", bits: float = 5.0, topology: Topology = "ring"
) -> tuple[Tensor, float]:
    """Runs the compressed all-reduce of ``inputs`` (one tensor per simulated rank) in this process, with one
    thread per rank and in-memory mailboxes: the same code and bytes as the distributed run. Returns rank
    0's result and the wire bits per coordinate (every rank ends with the same result). Integer, bool and
    empty tensors and a single rank take the exact sum, as ``all_reduce`` does; an error on any simulated rank
    stops them all, and the first one raised is raised here."""
    world_size = len(inputs)
    if inputs[0].is_complex():
        summed, wire_bits = simulate_all_reduce(
            [torch.view_as_real(x) for x in inputs], codec=codec, bits=bits, topology=topology
        )
        return torch.view_as_complex(summed), wire_bits
    if _exact(inputs[0], world_size, min_numel=1):
        exact = torch.stack(inputs).sum(dim=0).to(inputs[0].dtype)
        return exact, 8.0 * inputs[0].element_size() if world_size > 1 and exact.numel() else 0.0
    codec = make_codec(codec, bits)
    chunks = [_chunks(x, world_size, codec.block) for x in inputs]
    if not codec.agrees_finite:
        flags = [int(non_finite_flag(c, rank, _headroom(world_size))) for rank, c in enumerate(chunks)]
        raise_if_any_non_finite(max(flags), codec.name, world_size)
    transfer = plan_transfer(topology, world_size, chunks[0].shape[1], inputs[0].numel(), all_gather=True)
    domains = codec.prepare_simulated(chunks, transfer)
    mailboxes = {(src, dst): queue.SimpleQueue() for src in range(world_size) for dst in range(world_size)}
    failures: list[BaseException] = []

    def run(rank: int) -> tuple[Tensor, float]:
        def p2p(send: Tensor, recv: Tensor, dst: int, src: int) -> None:
            mailboxes[rank, dst].put(send.clone())
            try:
                received = mailboxes[src, rank].get(timeout=_SIMULATED_WAIT_S)
            except queue.Empty:
                raise TimeoutError(
                    f"simulated rank {rank} waited {_SIMULATED_WAIT_S} s for a message from rank {src}"
                ) from None
            if received is _STOP:
                raise _Stopped
            recv.copy_(received)

        try:
            ring = _Ring(codec, topology, rank, world_size, p2p)
            summed = ring.all_reduce(domains[rank])
        except _Stopped:
            raise
        except BaseException as error:
            failures.append(error)
            for mailbox in mailboxes.values():  # wakes every rank still waiting, whichever rank it waits for
                mailbox.put(_STOP)
            raise
        return summed, ring.wire_bytes

    with _finite_sums_agreed(codec), ThreadPoolExecutor(max_workers=world_size) as pool:
        futures = [pool.submit(run, rank) for rank in range(world_size)]
    if failures:
        raise failures[0]  # the first error; the other ranks only stopped waiting for the rank that raised it
    summed, wire = futures[0].result()
    summed = codec.finish(summed).reshape(-1)[: inputs[0].numel()]
    return summed.view_as(inputs[0]), 8 * (wire + codec.side_bytes) / transfer.reference_coords


def loopback_all_reduce(
    tensor: Tensor,
    *,
    world_size: int,
    codec: str | Codec = "dynamiq",
    bits: float = 5.0,
    topology: Topology = "ring",
) -> Tensor:
    """The compute that one rank of a ``world_size``-rank compressed all-reduce of ``tensor`` pays, on ``tensor``'s
    device and with no network: every message it sends comes back as the one it receives, which has the size and
    the number of summands of the message a real neighbour would send. So it runs a real rank's encodes, its
    ``world_size - 1`` ring hops (decompress-accumulate-recompress) and its all-gather's decodes, once each, with
    the host synchronisations of a real call (the finite check's one). The values returned are a mix of this
    rank's own chunks, not a sum over ranks: this is for timing (``fedshard bench dynamiq-step``) and counting.

    Example::

        grad = torch.randn(1 << 20)
        loopback_all_reduce(grad, world_size=8, codec="dynamiq", bits=5.0)   # what a rank of 8 computes
    """
    codec = make_codec(codec, bits)
    chunks = _chunks(tensor, world_size, codec.block)
    if not codec.agrees_finite:
        raise_if_any_non_finite(int(non_finite_flag(chunks, 0, _headroom(world_size))), codec.name, world_size)
    transfer = plan_transfer(topology, world_size, chunks.shape[1], tensor.numel(), all_gather=True)
    domain = codec.prepare_simulated([chunks] * world_size, transfer)[0]
    ring = _Ring(codec, topology, 0, world_size, _loop_back)
    with _finite_sums_agreed(codec):
        summed = codec.finish(ring.all_reduce(domain))
    return summed.reshape(-1)[: tensor.numel()].view_as(tensor)


def _loop_back(send: Tensor, recv: Tensor, dst: int, src: int) -> None:
    recv.copy_(send)


#: How long a simulated rank waits for a message before calling the simulation deadlocked.
_SIMULATED_WAIT_S = 600
#: Put in every mailbox when a simulated rank fails, so that no other rank waits for it.
_STOP = object()


class _Stopped(Exception):
    """A simulated rank gave up because another one failed."""


class _Ring:
    """One rank's side of one collective call: the codec, the transport and the bytes this rank sent.

    ``p2p(send, recv, dst, src)`` sends ``send`` to group rank ``dst`` while filling ``recv`` from ``src``:
    point-to-point ops on a process group, or in-memory mailboxes when ``simulate`` runs all ranks
    in one process.
    """

    def __init__(self, codec: Codec, topology: str, rank: int, world_size: int, p2p: _P2P) -> None:
        _check_topology(topology, world_size)
        self.codec = codec
        self.topology = topology
        self.rank = rank
        self.world_size = world_size
        self._send_recv = p2p
        self.wire_bytes = 0.0

    @classmethod
    def over(cls, codec: Codec, group: ProcessGroup | None, topology: str) -> _Ring:
        backend = dist.get_backend(group)

        def p2p(send: Tensor, recv: Tensor, dst: int, src: int) -> None:
            staged = needs_host_staging(backend, recv.device)
            into = torch.empty_like(recv, device="cpu") if staged else recv
            ops = [
                dist.P2POp(dist.isend, send.cpu() if staged else send, group=group, group_peer=dst),
                dist.P2POp(dist.irecv, into, group=group, group_peer=src),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            if staged:
                recv.copy_(into)

        return cls(codec, topology, dist.get_rank(group), dist.get_world_size(group), p2p)

    def all_reduce(self, domain: Tensor) -> Tensor:
        """Sums prepared ``[P, m]`` chunks; returns the decoded ``[P, m]`` sums, the same bits on every rank."""
        owned = self.reduce_scatter(domain)
        final = self.codec.encode(owned, self.world_size)
        messages = self._all_gather(final, domain.shape[1])
        return torch.stack([self.codec.decode(m, domain.shape[1], self.world_size) for m in messages])

    def reduce_scatter(self, domain: Tensor) -> Tensor:
        """The fp32 sum of prepared chunk ``rank`` over all ranks, hop errors included."""
        if self.topology == "ring":
            return self._ring_reduce_scatter(domain)
        return self._halving_reduce_scatter(domain)

    # ---------------------------------------------------------------- reduce-scatter
    def _ring_reduce_scatter(self, domain: Tensor) -> Tensor:
        p, r, m = self.world_size, self.rank, domain.shape[1]
        outgoing = self.codec.encode(domain[(r - 1) % p], 1)
        for hop in range(1, p):  # the received message holds `hop` chunks
            incoming = self._exchange([outgoing], (r + 1) % p, (r - 1) % p, m, hop, count=1)[0]
            local = domain[(r - hop - 1) % p]
            if hop == p - 1:
                return self.codec.decode(incoming, m, hop) + local
            outgoing = self.codec.accumulate(incoming, local, hop)
        raise AssertionError("a ring of one rank has no hops")

    def _halving_reduce_scatter(self, domain: Tensor) -> Tensor:
        p, r, m = self.world_size, self.rank, domain.shape[1]
        partial = {c: domain[c] for c in range(p)}
        summands = 1
        distance = p // 2
        while distance:
            partner = r ^ distance
            keep = sorted(c for c in partial if c & distance == r & distance)
            give = sorted(c for c in partial if c & distance != r & distance)
            outgoing = [self.codec.encode(partial[c], summands) for c in give]
            incoming = self._exchange(outgoing, partner, partner, m, summands, count=len(keep))
            partial = {
                c: self.codec.decode(msg, m, summands) + partial[c] for c, msg in zip(keep, incoming, strict=True)
            }
            summands *= 2
            distance //= 2
        return partial[r]

    # ---------------------------------------------------------------- all-gather
    def _all_gather(self, final: Tensor, m: int) -> list[Tensor]:
        p, r = self.world_size, self.rank
        messages: dict[int, Tensor] = {r: final}
        if self.topology == "ring":
            for step in range(p - 1):
                sent = messages[(r - step) % p]
                messages[(r - step - 1) % p] = self._exchange([sent], (r + 1) % p, (r - 1) % p, m, p, count=1)[0]
        else:
            distance = 1
            while distance < p:
                partner = r ^ distance
                mine = sorted(messages)
                theirs = sorted(c ^ distance for c in mine)
                received = self._exchange([messages[c] for c in mine], partner, partner, m, p, count=len(theirs))
                messages.update(zip(theirs, received, strict=True))
                distance *= 2
        return [messages[c] for c in range(p)]

    # ---------------------------------------------------------------- transport
    def _exchange(
        self, outgoing: list[Tensor], dst: int, src: int, numel: int, summands: int, *, count: int
    ) -> list[Tensor]:
        """Sends ``outgoing`` messages to ``dst`` while receiving ``count`` messages from ``src``. Fixed-size
        codecs' receive sizes are known in advance; others first exchange their byte counts."""
        device = outgoing[0].device
        if self.codec.fixed_size:
            sizes = [self.codec.message_bytes(numel, summands)] * count
        else:
            header = torch.tensor([m.numel() for m in outgoing], dtype=torch.int64, device=device)
            received = torch.empty(count, dtype=torch.int64, device=device)
            self._p2p(header, received, dst, src)
            sizes = received.tolist()
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        self._p2p(outgoing[0] if len(outgoing) == 1 else torch.cat(outgoing), buffer, dst, src)
        return list(buffer.split(sizes))

    def _p2p(self, send: Tensor, recv: Tensor, dst: int, src: int) -> None:
        self._send_recv(send, recv, dst, src)
        self.wire_bytes += send.numel() * send.element_size()


def needs_host_staging(backend: str, device: torch.device) -> bool:
    """Whether the ring's messages on ``device`` must go through host memory on a group of ``backend``
    (``dist.get_backend``): only CUDA tensors on a gloo-only group, as gloo's point-to-point ops read and write host
    memory. NCCL, and a group with a CUDA backend beside gloo (``"cpu:gloo,cuda:nccl"``), send them from the device.

    >>> needs_host_staging("gloo", torch.device("cuda", 0)), needs_host_staging("nccl", torch.device("cuda", 0))
    (True, False)
    """
    return backend == "gloo" and device.type == "cuda"


def warm_up(codec: Codec, numel: int, world_size: int, device: torch.device | str = "cpu") -> None:
    """``codec.warm_up`` for the chunks an all-reduce or reduce-scatter of ``numel`` coordinates over
    ``world_size`` ranks sends."""
    per_rank = -(-numel // world_size)
    codec.warm_up(-(-per_rank // codec.block) * codec.block, device)


def _chunks(tensor: Tensor, world_size: int, block: int) -> Tensor:
    """``tensor`` flattened to fp32 and zero-padded into ``world_size`` chunks of a multiple of ``block``."""
    per_rank = -(-tensor.numel() // world_size)
    chunk = -(-per_rank // block) * block
    if tensor.numel() == world_size * chunk:  # no padding: the chunks are a view of the tensor, or its fp32 copy
        return _as_chunks(tensor, world_size, chunk, block)
    flat = torch.zeros(world_size * chunk, dtype=torch.float32, device=tensor.device)
    flat[: tensor.numel()] = tensor.reshape(-1)
    return flat.view(world_size, chunk)


def _as_chunks(tensor: Tensor, world_size: int, chunk: int, block: int) -> Tensor:
    """``tensor`` (``world_size × chunk`` elements) as ``[world_size, chunk']`` fp32 chunks, ``chunk'`` the next
    multiple of ``block``. A view, with no copy, when the chunks are already whole blocks of a contiguous fp32
    tensor: the ring only reads them. Block-aligned shards (``BlockShardPlan``) make FSDP2's reduce-scatter input
    such a tensor."""
    if chunk % block == 0 and tensor.dtype == torch.float32 and tensor.is_contiguous():
        return tensor.view(world_size, chunk)
    padded = -(-chunk // block) * block
    chunks = torch.zeros(world_size, padded, dtype=torch.float32, device=tensor.device)
    chunks[:, :chunk] = tensor.reshape(world_size, chunk)
    return chunks


def _exact(tensor: Tensor, world_size: int, min_numel: int) -> bool:
    """Whether ``tensor`` takes the plain all-reduce: a group of one, or a tensor too small to gain. Integer and
    bool tensors too: they hold counts, masks and flags, whose sum must be exact (through a lossy codec nearly every
    int64 count comes out wrong), and ``dist.all_reduce``, which these collectives stand in for, sums them exactly.
    DDP and FSDP hand over floating-point gradients only (DDP views complex ones as real)."""
    return world_size == 1 or tensor.numel() < max(min_numel, 1) or not tensor.is_floating_point()


def _agree_finite(codec: Codec, chunks: Tensor, group: ProcessGroup | None) -> None:
    """Makes every rank raise the same error, before the first message, when any rank's chunks hold NaN or Inf:
    a rank raising alone would leave the others blocked in the ring until the group's timeout. A one-element
    all-reduce, except for codecs that fold the flag into a collective of their own; its 8 bytes are control,
    the same for every tensor, and not counted in the wire bytes."""
    if codec.agrees_finite:
        return
    world_size = dist.get_world_size(group)
    flag = non_finite_flag(chunks, dist.get_rank(group), _headroom(world_size))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    raise_if_any_non_finite(int(flag), codec.name, world_size)  # the call's one host synchronisation


def _headroom(world_size: int) -> int:
    """How many times the largest |chunk value| must fit in fp32 for no partial sum of the ring to overflow: a
    message of ``h`` summands decodes to at most ``h`` times it (a group decodes within its scale, its max |x|), and
    a factor 2 covers the rounding of the decodes and adds."""
    return 2 * world_size


@contextmanager
def _finite_sums_agreed(codec: Codec) -> Iterator[None]:
    """Marks ``codec`` as running a collective whose chunks every rank found finite with ``_headroom`` (by
    ``_agree_finite``), so that it may skip its per-message check: on a GPU a host synchronisation per hop, and,
    with the finite inputs agreed, one that could only fire on one rank and leave the others waiting for it."""
    if codec.agrees_finite:  # its prepare checked finiteness, not the headroom
        yield
        return
    codec.sums_known_finite = True
    try:
        yield
    finally:
        codec.sums_known_finite = False


def _check_topology(topology: str, world_size: int) -> None:
    if topology not in TOPOLOGIES:
        raise ValueError(f"Unknown topology {topology!r}; expected one of {TOPOLOGIES}.")
    if topology == "butterfly" and world_size & (world_size - 1):
        raise ValueError(f"The butterfly topology needs a power-of-two group size, got {world_size}.")


def _exact_sum(tensor: Tensor, group: ProcessGroup | None) -> Tensor:
    reference = tensor.detach().to(torch.float64 if tensor.device.type == "cpu" else torch.float32, copy=True)
    dist.all_reduce(reference, group=group)
    return reference


def _squared_distance(tensor: Tensor, reference: Tensor) -> float:
    return float((tensor.detach().to(reference.dtype) - reference).square().sum())


def _record(stats: CompressionStats | None, ring: _Ring, numel: int, transfer: Transfer, rechunked: bool) -> None:
    if stats is not None:
        stats.record(numel, ring.wire_bytes + ring.codec.side_bytes, transfer.reference_coords, compressed=True)
        stats.rechunked_calls += int(rechunked)


def _record_plain(stats: CompressionStats | None, tensor: Tensor, world_size: int, factor: int) -> None:
    if stats is not None and world_size > 1:
        coords = factor * (world_size - 1) / world_size * tensor.numel()
        stats.record(tensor.numel(), coords * tensor.element_size(), coords, compressed=False)
