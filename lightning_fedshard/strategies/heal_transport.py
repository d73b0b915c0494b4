"""Healing a federation group: its state streamed from a live peer into its own tensors, over the quorum's process
group, in chunks.

torchft's default checkpoint transport (HTTP) pickles the whole state into a socket with ``torch.save``'s
serialiser and the receiver unpickles it into freshly allocated tensors: the receiver holds a second copy of its
state before copying it in, a Python socket loop carries the bytes, and the sender has to keep a copy of its state
alive while it serves it (the HTTP server serves from another thread after the round has moved on). Here the sender
sends each tensor's bytes straight from its live shards and the receiver receives them straight into its own live
shards, :data:`CHUNK_BYTES` at a time with :data:`WINDOW` chunks in flight, over the process group torchft has just
configured for the quorum. Neither side copies the state; the sender's quorum returns only once everything is sent,
so nothing it sends changes on the way (its training waits on the quorum).

Only the small rest (the tree's structure, the shapes and dtypes, the progress counters) is pickled, as torchft's
own transports do: peers of one federation trust each other.

A transfer that breaks after the first byte has landed leaves the receiver's tensors part its own, part the peer's:
:attr:`StreamingTransport.torn` says so, and the strategy then stops the group rather than train on such a state (a
restarted group heals afresh).
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.utils._pytree import KeyPath, tree_flatten_with_path, tree_unflatten, treespec_dumps, treespec_loads

__all__ = ["CHUNK_BYTES", "WINDOW", "StreamingTransport"]

#: Bytes of one message: large enough that gloo's per-message cost vanishes, small enough to keep a timeout per chunk.
CHUNK_BYTES = 32 << 20
#: Chunks in flight per peer: the next one is posted while the previous ones are on the wire.
WINDOW = 4
_HEADER_LENGTH_TAG, _HEADER_TAG, _FIRST_CHUNK_TAG = 1, 2, 3


@dataclass(frozen=True)
class _TensorLeaf:
    shape: torch.Size
    dtype: torch.dtype


@dataclass(frozen=True)
class _Header:
    step: int
    treespec: str  # treespec_dumps: pickling a TreeSpec itself is deprecated
    paths: list[KeyPath]
    leaves: list[Any]  # a _TensorLeaf for every tensor, the value itself otherwise


class StreamingTransport:
    """A torchft ``CheckpointTransport`` that streams a state in place, chunk by chunk, over ``pg``.

    ``live_state`` returns the receiver's own state, the same tree the sender's ``state_dict`` has: every tensor of
    the peer's state is received into the tensor at the same place of it (same shape and dtype, or nothing is
    received and the heal fails naming the difference). Tensors are sent from where they live, without copies.

    Example::

        transport = StreamingTransport(pg, timedelta(seconds=60), live_state=lambda: manager._manager_state_dict())
        manager = Manager(pg=pg, checkpoint_transport=transport, ...)
    """

    def __init__(
        self,
        pg: Any,
        timeout: timedelta,
        live_state: Callable[[], Any],
        chunk_bytes: int = CHUNK_BYTES,
        window: int = WINDOW,
    ) -> None:
        self._pg = pg
        self._timeout = timeout
        self._live_state = live_state
        self._chunk_bytes = chunk_bytes
        self._window = window
        self.torn = False
        """Whether a receive broke after writing into the live state (cleared by the next complete one)."""
        self.bytes_moved = 0
        """Tensor bytes of the last send (per destination) or receive."""

    def metadata(self) -> str:
        return "<process group>"

    def disallow_checkpoint(self) -> None:
        pass  # the sender is done when send_checkpoint returns

    def shutdown(self, wait: bool = True) -> None:
        pass

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        leaves, treespec = tree_flatten_with_path(state_dict)
        tensors = [value for _, value in leaves if isinstance(value, torch.Tensor)]
        header = _Header(
            step,
            treespec_dumps(treespec),
            [path for path, _ in leaves],
            [_TensorLeaf(v.shape, v.dtype) if isinstance(v, torch.Tensor) else v for _, v in leaves],
        )
        encoded = torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8)
        length = torch.tensor([encoded.numel()], dtype=torch.int64)
        in_flight: deque[Any] = deque()
        for dst in dst_ranks:
            in_flight.append(self._pg.send([length], dst, _HEADER_LENGTH_TAG))
            in_flight.append(self._pg.send([encoded], dst, _HEADER_TAG))
        for tag, chunk in enumerate(self._chunks([_contiguous(t) for t in tensors]), _FIRST_CHUNK_TAG):
            for dst in dst_ranks:
                in_flight.append(self._pg.send([chunk], dst, tag))
            while len(in_flight) > self._window * len(dst_ranks):
                in_flight.popleft().wait(timeout)
        while in_flight:
            in_flight.popleft().wait(timeout)
        self.bytes_moved = sum(t.numel() * t.element_size() for t in tensors)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        length = torch.zeros(1, dtype=torch.int64)
        self._pg.recv([length], src_rank, _HEADER_LENGTH_TAG).wait(timeout)
        encoded = torch.empty(int(length.item()), dtype=torch.uint8)
        self._pg.recv([encoded], src_rank, _HEADER_TAG).wait(timeout)
        header: _Header = pickle.loads(encoded.numpy().tobytes())
        if header.step != step:
            raise RuntimeError(f"healing at step {step}, but the peer sends its state of step {header.step}")
        live = dict(tree_flatten_with_path(self._live_state())[0])
        values = [self._destination(path, leaf, live.get(path)) for path, leaf in zip(header.paths, header.leaves)]
        tensors = [v for v, leaf in zip(values, header.leaves) if isinstance(leaf, _TensorLeaf)]
        staged = [(t, _contiguous(t)) for t in tensors]
        in_flight: deque[Any] = deque()
        for tag, chunk in enumerate(self._chunks([buffer for _, buffer in staged]), _FIRST_CHUNK_TAG):
            in_flight.append(self._pg.recv([chunk], src_rank, tag))
            self.torn = True  # until every chunk has landed
            while len(in_flight) > self._window:
                in_flight.popleft().wait(timeout)
        while in_flight:
            in_flight.popleft().wait(timeout)
        for tensor, buffer in staged:
            if buffer is not tensor:
                tensor.copy_(buffer)
        self.torn = False
        self.bytes_moved = sum(t.numel() * t.element_size() for t in tensors)
        return tree_unflatten(values, treespec_loads(header.treespec))

    def _destination(self, path: KeyPath, leaf: Any, live: Any) -> Any:
        """Where a leaf of the peer's state goes: the live tensor at its place, or the value itself."""
        if not isinstance(leaf, _TensorLeaf):
            return leaf
        if not isinstance(live, torch.Tensor) or live.shape != leaf.shape or live.dtype != leaf.dtype:
            mine = f"{tuple(live.shape)} {live.dtype}" if isinstance(live, torch.Tensor) else "nothing"
            raise ValueError(
                f"healing: the peer sends {_name(path)} as {tuple(leaf.shape)} {leaf.dtype}, this group holds {mine}"
                " there; every group must train the same model with the same sharding"
            )
        return live

    def _chunks(self, tensors: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Byte views of at most ``chunk_bytes`` each, over ``tensors`` in order (no copies)."""
        for tensor in tensors:
            flat = tensor.reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), self._chunk_bytes):
                yield flat[start : start + self._chunk_bytes]


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its bytes are one run (the shards and outer state always are), else a copy of it."""
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _name(path: KeyPath) -> str:
    return "".join(str(key) for key in path)
