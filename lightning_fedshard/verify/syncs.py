"""Counting the host synchronisations of a run: the tensor operations that make the CPU wait for a CUDA device.

On CUDA the verifier's kernels queue up and run while Python goes on; an operation that needs a tensor's value or
its data-dependent size on the host (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``, ``nonzero``, a boolean
mask as an index, ``unique``, ``torch.tensor(data, device=...)``) waits until the queue has drained. Small nets pay
the kernel launch latency (5–10 µs a kernel) once per such wait, so a loop that synchronises per neuron, per
domain or per layer runs no faster on a GPU than on one CPU core. :class:`SyncCounter` counts them per call site
(``file:line`` of the verifier's code that asked), per phase of :func:`~lightning_fedshard.verify.verify` and per
branch-and-bound round; on the CPU it counts what would synchronise if the run's tensors lived on a GPU.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["SyncCounter", "note_round", "phase"]

#: The phase of a run the verifier is in (``_Run.timed`` names them: attack, crown, alpha-crown, bab, ...).
_PHASE: ContextVar[str] = ContextVar("verify_phase", default="other")
#: The counter in force, if any (branch-and-bound rounds are counted for it).
_ACTIVE: ContextVar[SyncCounter | None] = ContextVar("sync_counter", default=None)

#: Tensor methods that read values on the host: one synchronisation each.
_READS = {
    "item",
    "tolist",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__format__",
    "__array__",
    "cpu",
}
#: Operations whose result's size depends on the values: the host waits for them to learn it.
_SIZED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "_unique2"}
#: Where a call site is looked for: the first frame outside torch and this module.
_SKIPPED = (str(Path(torch.__file__).parent), __file__)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Syncs inside the block count for phase ``name`` (nothing else changes; costs a context variable)."""
    token = _PHASE.set(name)
    try:
        yield
    finally:
        _PHASE.reset(token)


def note_round() -> None:
    """Counts one branch-and-bound round of the current phase for the counter in force (none: nothing)."""
    counter = _ACTIVE.get()
    if counter is not None:
        counter.rounds[_PHASE.get()] += 1


class SyncCounter(TorchFunctionMode):
    """Counts host synchronisations inside a ``with`` block, per ``(phase, kind, call site)``.

    ``kind`` is ``read`` (a value read on the host: ``item``, ``bool``, ``tolist``, ``cpu``, ...), ``size`` (an
    output whose size depends on the values: ``nonzero``, a boolean-mask index, ``unique``, ``where(cond)``) or
    ``upload`` (``torch.tensor``/``as_tensor`` of host data onto a device, which waits for the queue too).

    On a CUDA run only tensors on a GPU count. With ``assume_device=True`` (the default where CUDA is not
    available) every tensor counts as if it were on the GPU, except those a ``.cpu()``/``.to("cpu")`` in the block
    made, and what is computed from those alone (reading those costs nothing more): the CPU tells what a GPU run
    would wait for.

    Example::

        with SyncCounter() as syncs:
            verify_files("net.onnx", "prop.vnnlib", VerifyConfig(device="cpu"))
        print(syncs.total, syncs.by_phase(), syncs.top(5))
    """

    def __init__(self, assume_device: bool | None = None) -> None:
        super().__init__()
        self.assume_device = (not torch.cuda.is_available()) if assume_device is None else assume_device
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.rounds: Counter[str] = Counter()
        self._host: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._token = None

    def __enter__(self) -> SyncCounter:
        self._token = _ACTIVE.set(self)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        _ACTIVE.reset(self._token)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def by_phase(self) -> dict[str, int]:
        """Syncs per phase, in the order the phases first synchronised."""
        out: dict[str, int] = {}
        for (name, _, _), n in self.counts.items():
            out[name] = out.get(name, 0) + n
        return out

    def top(self, count: int, phase_name: str | None = None) -> list[tuple[str, str, int]]:
        """The ``count`` call sites with the most syncs (of ``phase_name`` only, if given): ``(site, kind, n)``."""
        sites: Counter[tuple[str, str]] = Counter()
        for (name, kind, site), n in self.counts.items():
            if phase_name is None or name == phase_name:
                sites[site, kind] += n
        return [(site, kind, n) for (site, kind), n in sites.most_common(count)]

    # ------------------------------------------------------------------------------------------------ the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        kind = self._kind(getattr(func, "__name__", ""), args, kwargs)
        if kind is not None:
            self.counts[_PHASE.get(), kind, _call_site()] += 1
        if isinstance(result, torch.Tensor) and (_to_host(func, args, kwargs) or self._from_host(args)):
            self._host[id(result)] = result
        return result

    def _from_host(self, args) -> bool:
        """Whether the tensors among ``args`` (one at least) are all host copies: so is what is made of them."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return bool(tensors) and all(self._host.get(id(t)) is t for t in tensors)

    def _on_device(self, tensor) -> bool:
        if not isinstance(tensor, torch.Tensor):
            return False
        if tensor.device.type != "cpu":
            return True
        return self.assume_device and self._host.get(id(tensor)) is not tensor

    def _kind(self, name: str, args, kwargs) -> str | None:
        first = args[0] if args else None
        if name in _READS or (name == "to" and _to_host_args(args, kwargs)):
            return "read" if self._on_device(first) else None
        if name in _SIZED or (name == "where" and len(args) + len(kwargs) == 1):
            return "size" if self._on_device(first) else None
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and self._on_device(first):
            return "size" if _has_mask(args[1] if len(args) > 1 else None) else None
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return "size" if self._on_device(repeats) else None
        if name in ("tensor", "as_tensor") and not isinstance(first, torch.Tensor):
            device = kwargs.get("device")
            on_device = device is not None and (torch.device(device).type != "cpu" or self.assume_device)
            return "upload" if on_device else None
        return None


def _has_mask(index) -> bool:
    """Whether an index holds a boolean tensor (indexing with it is ``nonzero`` first)."""
    items = index if isinstance(index, tuple | list) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _to_host_args(args, kwargs) -> bool:
    targets = [*args[1:], kwargs.get("device")]
    return any((isinstance(t, str | torch.device) and torch.device(t).type == "cpu") for t in targets if t is not None)


def _to_host(func, args, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    return name == "cpu" or (name == "to" and _to_host_args(args, kwargs))


def _call_site() -> str:
    """``path:line (function)`` of the innermost caller outside torch and this module (relative to the
    repository where it lies inside)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    if path.startswith(_PACKAGE_ROOT):
        path = path[len(_PACKAGE_ROOT) + 1 :]
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
