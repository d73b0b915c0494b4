"""Peak memory of one process (one rank) during bound propagation, measured around a block of code.

Why a dedicated meter instead of the usual tools:

* ``tracemalloc`` only sees allocations made through Python's allocator; torch allocates tensor memory in C++
  (``posix_memalign``/``mmap`` on CPU), so tracemalloc reports 0 bytes for a 1 GiB tensor.
* ``resource.getrusage(...).ru_maxrss`` is the high-water mark of the whole process since it started and cannot
  be reset, so it cannot tell the peak of one propagation from the peak of loading the model, of an earlier
  instance, or of another library; it also counts pages (``torch.empty`` that is never written adds nothing).
* On CUDA the caching allocator keeps exact statistics that can be reset, so the meter uses them there.

On CPU (and any device without such statistics) the meter installs a ``TorchDispatchMode`` that sees the
output of every aten op run inside the context, counts each newly created tensor storage once (views and
in-place/``out=`` results share an existing storage and are not counted again) and subtracts it when the
storage is freed. That count is exact and independent of the allocator (glibc, jemalloc, page faults), but:

* it counts only storages created inside the context by aten ops; memory that exists before it (the model's
  weights, the rank's shard) must be passed as ``resident_bytes`` (see :func:`tensor_bytes`), and memory made
  without an op (``torch.from_numpy``, ``torch.frombuffer``) is not seen;
* it misses memory that is not a tensor: BLAS/oneDNN workspaces, Python objects, the allocator's own overhead;
* growth of a storage created outside the context (``resize_`` of an outside tensor) is not counted.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_fedshard._torch_compat import TorchDispatchMode, tree_leaves

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

__all__ = ["PeakMemoryMeter", "cuda_meter_active", "tensor_bytes"]


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes held by the distinct storages behind ``tensors``: tensors that share a storage (views, tied
    weights) count it once. Tensors without memory (meta, zero elements) add 0."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        data_ptr = storage.data_ptr()
        if data_ptr == 0 or data_ptr in seen:
            continue
        seen.add(data_ptr)
        total += storage.nbytes()
    return total


# How an op's outputs relate to its inputs, read once per op from its schema (``Tensor(a)`` = view of an
# input, ``Tensor(a!)`` = an input written in place or an ``out=`` argument, plain ``Tensor`` = new memory).
_NEW_STORAGE, _WRITES_INPUT, _VIEWS_INPUT = 0, 1, 2
# _unsafe_view returns a view of its input although its schema does not say so.
_OUTPUT_KIND: dict[object, int] = {torch.ops.aten._unsafe_view.default: _VIEWS_INPUT}


def _output_kind(func: object) -> int:
    schema = getattr(func, "_schema", None)
    aliases = [ret.alias_info for ret in schema.returns if ret.alias_info is not None] if schema is not None else []
    if not aliases:
        kind = _NEW_STORAGE
    elif any(alias.is_write for alias in aliases):
        kind = _WRITES_INPUT
    else:
        kind = _VIEWS_INPUT
    _OUTPUT_KIND[func] = kind
    return kind


class _LiveStorageCounter(TorchDispatchMode):
    """Bytes of the tensor storages created by the ops run under this mode that are still alive, and their max.

    Storages are keyed by the identity of their Python object: torch keeps one Python object per storage for
    as long as the storage lives (views and ``untyped_storage()`` calls all return it), and a weakref to it
    fires exactly when the storage is freed. Unlike ``data_ptr()`` the key survives ``resize_``, which moves
    the memory, so a resized storage is neither lost nor confused with a new allocation at its old address.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_live_bytes = 0
        # id(storage) -> [weakref to the storage, bytes counted for it]
        self._tracked: dict[int, list] = {}

    def detach(self) -> None:
        """Forget all storages: dropping the weakrefs drops their callbacks, so storages freed later (results
        that outlive the context) no longer touch this counter."""
        self._tracked.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = _OUTPUT_KIND.get(func)
        if kind is None:
            kind = _output_kind(func)
        if kind == _VIEWS_INPUT:
            return out
        observe = self._track_new if kind == _NEW_STORAGE else self._track_growth
        if isinstance(out, Tensor):
            observe(out)
        else:
            for leaf in tree_leaves(out):
                if isinstance(leaf, Tensor):
                    observe(leaf)
        return out

    def _track_new(self, tensor: Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and some subclasses have no single storage
            return
        key = id(storage)
        if key in self._tracked:
            return
        nbytes = storage.nbytes()
        if nbytes and not storage.data_ptr():  # meta/fake tensors: a size but no memory
            return
        # Zero-byte storages are tracked too: an ``out=torch.empty(0)`` argument grows later (_track_growth).
        self._tracked[key] = [weakref.ref(storage, lambda _, key=key: self._release(key)), nbytes]
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def _track_growth(self, tensor: Tensor) -> None:
        # In-place and out= ops return an existing storage; it only matters if it is ours and was resized.
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        entry = self._tracked.get(id(storage))
        if entry is None:
            return
        nbytes = storage.nbytes()
        if nbytes != entry[1]:
            self.live_bytes += nbytes - entry[1]
            entry[1] = nbytes
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def _release(self, key: int) -> None:
        entry = self._tracked.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[1]


# CUDA meters reset the device's peak statistics on enter, which would corrupt an enclosing meter's peak.
_metered_cuda_devices: set[int] = set()


def cuda_meter_active(device: torch.device) -> bool:
    """Whether a :class:`PeakMemoryMeter` is active on this GPU (another one there would reset its statistics)."""
    if device.type != "cuda":
        return False
    return (device.index if device.index is not None else torch.cuda.current_device()) in _metered_cuda_devices


class PeakMemoryMeter:
    """Baseline and peak memory of this process on ``device`` while the ``with`` block runs.

    Example::

        weights = tensor_bytes(model.parameters())
        meter = PeakMemoryMeter(device=torch.device("cpu"), resident_bytes=weights)
        with meter:
            bounds_setup = prepare(graph, box)
            meter.mark_baseline()  # everything before this is "setup"
            bounds = propagate(bounds_setup)
        print(meter.baseline_bytes, meter.peak_bytes)

    On CPU (and devices other than CUDA) the bytes are those of tensor storages created inside the block
    (counted by a dispatch mode, see the module docstring) plus ``resident_bytes``, the memory the caller holds
    from before (weights, shards): ``baseline_bytes`` is ``resident_bytes`` plus what is alive when
    :meth:`mark_baseline` is called (just ``resident_bytes`` if it is never called), ``peak_bytes`` is
    ``resident_bytes`` plus the most that was alive at once.

    On CUDA the numbers come from the caching allocator, which already sees every tensor on the device,
    weights included, so ``resident_bytes`` is *not* added: ``baseline_bytes`` is
    ``torch.cuda.memory_allocated`` at :meth:`mark_baseline` (at enter if it is never called) and
    ``peak_bytes`` is ``torch.cuda.max_memory_allocated`` since enter. Entering resets the device's peak
    statistics, so CUDA meters on the same device cannot be nested.

    A meter can be used again after it exits (it starts from zero); entering it while it is active raises.
    """

    def __init__(self, device: torch.device | str = "cpu", resident_bytes: int = 0) -> None:
        self.device = torch.device(device)
        self.resident_bytes = int(resident_bytes)
        self._uses_cuda_allocator = self.device.type == "cuda"
        self._counter: _LiveStorageCounter | None = None
        self._active = False
        self._baseline_live = 0
        self._peak_live = 0
        self._live_at_exit = 0

    @property
    def baseline_bytes(self) -> int:
        """Memory when :meth:`mark_baseline` was called (see the class docstring for what is counted)."""
        return self._baseline_live if self._uses_cuda_allocator else self.resident_bytes + self._baseline_live

    @property
    def peak_bytes(self) -> int:
        """Most memory in use at once since enter; while the block runs, the peak so far."""
        if self._uses_cuda_allocator:
            return torch.cuda.max_memory_allocated(self.device) if self._active else self._peak_live
        peak_live = self._counter.peak_live_bytes if self._active else self._peak_live
        return self.resident_bytes + peak_live

    @property
    def live_bytes(self) -> int:
        """Memory in use now (at exit, once the block has ended), counted like :attr:`peak_bytes`."""
        if self._uses_cuda_allocator:
            return torch.cuda.memory_allocated(self.device) if self._active else self._live_at_exit
        live = self._counter.live_bytes if self._active else self._live_at_exit
        return self.resident_bytes + live

    def mark_baseline(self) -> None:
        """Record the memory in use now as the baseline: call it after setup, before propagation."""
        if not self._active:
            raise RuntimeError("PeakMemoryMeter.mark_baseline() must be called inside the `with meter:` block")
        if self._uses_cuda_allocator:
            self._baseline_live = torch.cuda.memory_allocated(self.device)
        else:
            self._baseline_live = self._counter.live_bytes

    def __enter__(self) -> Self:
        if self._active:
            raise RuntimeError("PeakMemoryMeter is already active: it cannot be entered again inside its own block")
        if self._uses_cuda_allocator:
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            if index in _metered_cuda_devices:
                raise RuntimeError(
                    f"another PeakMemoryMeter is active on cuda:{index}; nesting would reset its peak statistics"
                )
            _metered_cuda_devices.add(index)
            self._cuda_index = index
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline_live = torch.cuda.memory_allocated(self.device)
        else:
            self._counter = _LiveStorageCounter()
            self._baseline_live = 0
            self._counter.__enter__()
        self._active = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._active = False
        if self._uses_cuda_allocator:
            self._peak_live = torch.cuda.max_memory_allocated(self.device)
            self._live_at_exit = torch.cuda.memory_allocated(self.device)
            _metered_cuda_devices.discard(self._cuda_index)
        else:
            counter, self._counter = self._counter, None
            counter.__exit__(exc_type, exc, traceback)
            self._peak_live = counter.peak_live_bytes
            self._live_at_exit = counter.live_bytes
            counter.detach()
