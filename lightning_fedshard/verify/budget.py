"""What one instance may spend: the deadline it answers by and the memory its bound passes may hold.

One :class:`Budget` is made per instance and held by the run (:meth:`Budget.using`); the passes that allocate in
proportion to the net ask it how many rows, domains or boxes fit before they allocate
(:meth:`Budget.items_per_chunk`, :func:`run_in_chunks`): all at once when an upper estimate fits, else a first
chunk by that estimate, measured, and the rest by the measured bytes and seconds per item. What is free is the
budget less the growth of the process's resident set since the budget was made (what the OOM killer counts); a
chunk is measured in tensor bytes (:class:`~lightning_fedshard.verify.memory.PeakMemoryMeter`), which grow
linearly with its rows, and sized to :data:`CHUNK_SHARE` of what is free, leaving the rest to the allocator. A pass
that cannot fit even one item raises :class:`MemoryBudgetExceeded`, whose message says what it needs: the verifier
answers ``unknown`` with that reason instead of being killed. Between chunks the deadline is kept: a chunk that the
measured pace puts past it is not started.

Example::

    budget = Budget.start(timeout=60, memory_gib=4.0)
    with budget.using():
        rows = run_in_chunks("crown:relu1", 4096, bytes_per_row, lambda part: bound(part))
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from lightning_fedshard.verify.memory import PeakMemoryMeter, cuda_meter_active
from lightning_fedshard.verify.shard.lockstep import DeadlineExceeded, agree, agree_least, alone, past

if TYPE_CHECKING:
    from lightning_fedshard.verify.config import VerifyConfig

__all__ = [
    "CHUNK_SHARE",
    "Budget",
    "MemoryBudgetExceeded",
    "available_memory",
    "check_deadline",
    "check_deadline_between_steps",
    "current_budget",
    "peak_resident_bytes",
    "run_in_chunks",
    "seconds_left",
    "time_is_up",
]

T = TypeVar("T")
GIB = 1 << 30
#: A chunk's tensors are sized to this share of the free budget: the allocator holds more than the live tensors
#: (glibc's heap kept 1.0–1.9× their bytes resident in chunked CROWN passes; docs/benchmarks.md).
CHUNK_SHARE = 0.5
#: A pass above this many tensor bytes runs in chunks of this size even where it fits whole: one operator step of a
#: whole YOLO-sized pass (8 GiB budget) took over a second, past the deadline; chunks of 512 MiB take a fraction.
_LARGE_PASS_BYTES = 512 << 20
#: A pass estimated below this (and below a sixteenth of the budget) runs whole without asking what is free (ACAS
#: Xu's passes: thousands a second).
_SMALL_PASS_BYTES = 64 << 20
_READ_EVERY_S = 0.02


class MemoryBudgetExceeded(Exception):
    """A pass needs more memory than the budget leaves it, even one row (or domain, or box) at a time."""

    def __init__(self, what: str, needed: float, budget: int) -> None:
        super().__init__(
            f"needs {needed / GIB:.1f} GiB at {what}, memory budget {budget / GIB:.1f} GiB "
            "(--memory to raise it; --devices N --strategy fsdp to shard the weights over ranks)"
        )
        self.what, self.needed, self.budget = what, needed, budget


def _cgroup_free(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process's cgroup may still take (v2 ``memory.max``, or v1 ``memory.limit_in_bytes``), if limited."""
    for limit, usage in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            text = (root / limit).read_text().strip()
            used = int((root / usage).read_text().strip())
        except (OSError, ValueError):
            continue
        if text == "max" or int(text) >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
        return max(0, int(text) - used)
    return None


def available_memory(device: torch.device) -> int:
    """Bytes a new allocation on ``device`` can take now: ``torch.cuda.mem_get_info``'s free bytes on CUDA; on the CPU
    ``MemAvailable`` of ``/proc/meminfo``, or less if the process's cgroup limit leaves less."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    free: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    if free is None:  # not Linux: the physical memory, as the OS reports it
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cgroup = _cgroup_free()
    return free if cgroup is None else min(free, cgroup)


def _status_bytes(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class _Pace:
    """Measured cost of one item (a row, a domain, a box) of a chunked pass."""

    bytes_per_item: float
    seconds_per_item: float
    items: int


@dataclass
class Budget:
    """The deadline (a ``time.monotonic()`` value) and the working ``memory`` (bytes, on top of what the process
    held when the budget was made: the interpreter, the model) of one instance on ``device``.

    Example::

        budget = Budget.start(timeout=30.0, memory_gib=None)  # default: a share of the memory free now
        with budget.using():
            result = verify(graph, prop, config)
        print(budget.memory / 2**30, "GiB, of which", budget.in_use() / 2**30, "held now")
    """

    deadline: float
    memory: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: What the process held when the budget was made (resident set on the CPU, allocated bytes on CUDA).
    baseline: int = 0
    _paces: dict[str, _Pace] = field(default_factory=dict)
    _read_at: tuple[float, int] | None = None
    _tight: set[str] = field(default_factory=set)

    @classmethod
    def start(
        cls,
        timeout: float,
        memory_gib: float | None = None,
        fraction: float = 0.4,
        device: torch.device | str = "cpu",
    ) -> Budget:
        """A budget from now: ``timeout`` seconds, and ``memory_gib`` GiB, or ``fraction`` of the memory free on
        ``device`` now (so that processes side by side each keep theirs)."""
        device = torch.device(device)
        if memory_gib is not None:
            memory = int(memory_gib * GIB)
        else:
            memory = int(fraction * available_memory(device))
        return cls(time.monotonic() + timeout, memory, device, _in_use(device))

    @classmethod
    def from_config(cls, config: VerifyConfig, device: torch.device | str = "cpu") -> Budget:
        """A budget from now with ``config.timeout``, ``config.memory`` and ``config.memory_fraction``."""
        return cls.start(config.timeout, config.memory, config.memory_fraction, device)

    # --- time -------------------------------------------------------------------------------------------------
    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def expired(self) -> bool:
        """Whether the deadline has passed (on any rank of a sharded run: they all stop together)."""
        return past(self.deadline)

    @contextmanager
    def within(self, seconds: float) -> Iterator[None]:
        """Inside the block the deadline is at most ``seconds`` from now (a phase's share of the timeout)."""
        saved = self.deadline
        self.deadline = min(saved, time.monotonic() + seconds)
        try:
            yield
        finally:
            self.deadline = saved

    # --- memory -----------------------------------------------------------------------------------------------
    def in_use(self) -> int:
        """Bytes held now above the baseline (on the CPU read at most every 20 ms: the read costs ~20 µs, and small
        passes ask often)."""
        now = time.monotonic()
        if self._read_at is None or now - self._read_at[0] > _READ_EVERY_S:
            self._read_at = (now, _in_use(self.device))
        return max(0, self._read_at[1] - self.baseline)

    def free(self) -> int:
        return max(0, self.memory - self.in_use())

    # --- the run's budget -------------------------------------------------------------------------------------
    @contextmanager
    def using(self) -> Iterator[Budget]:
        """Make this the budget that :func:`current_budget` returns inside the block."""
        _budgets.append(self)
        try:
            yield self
        finally:
            _budgets.pop()

    def items_per_chunk(self, what: str, count: int, estimate: float) -> int:
        """How many of ``count`` items of pass ``what`` to bound at once: all if the estimated ``estimate`` bytes
        per item (or the measured bytes of an earlier chunk of ``what``) fit the free budget, else as many as fit.
        Raises :class:`MemoryBudgetExceeded` if not even one fits; sharded, every rank gets the least of them."""
        pace = self._paces.get(what)
        per_item = max(pace.bytes_per_item if pace is not None else estimate, 1.0)
        if pace is None and per_item * count <= min(_SMALL_PASS_BYTES, self.memory / 16):  # the same on every rank
            return count
        items = min(count, int(CHUNK_SHARE * self.free() // per_item))
        if per_item * count > _LARGE_PASS_BYTES:  # chunks short enough to keep the deadline between them
            items = min(items, max(1, int(_LARGE_PASS_BYTES // per_item)))
        items = agree_least(items)
        if items < 1:
            raise MemoryBudgetExceeded(what, per_item + self.in_use(), self.memory)
        if items < count:
            self._tight.add(what)
        return items

    def measuring_if_tight(self, what: str, items: int) -> AbstractContextManager[None]:
        """:meth:`measuring` once :meth:`items_per_chunk` had to cut ``what`` (a pass that always fits whole is
        not measured: on the CPU the live-tensor count costs ~5 µs per op, as much as a small op itself)."""
        return self.measuring(what, items) if what in self._tight else nullcontext()

    def items_that_fit(self, bytes_per_item: float, wanted: int) -> int:
        """At most ``wanted`` items of ``bytes_per_item`` each that fit the free budget now (at least one: for passes
        whose items are small next to any budget, the boxes of input splitting)."""
        return max(1, min(wanted, int(CHUNK_SHARE * self.free() // max(bytes_per_item, 1.0))))

    @contextmanager
    def measuring(self, what: str, items: int) -> Iterator[None]:
        """Measure the peak tensor bytes (:class:`~lightning_fedshard.verify.memory.PeakMemoryMeter`: the live
        storages on the CPU, the caching allocator on CUDA) and the seconds of a chunk of ``items`` items of pass
        ``what``: the next chunk of ``what`` is sized by them."""
        meter = PeakMemoryMeter(self.device) if not cuda_meter_active(self.device) else None
        start = time.monotonic()
        with meter or nullcontext():
            yield
        seconds = time.monotonic() - start
        if meter is not None:
            peak = meter.peak_bytes - (meter.baseline_bytes if self.device.type == "cuda" else 0)
        else:  # an enclosing meter holds this GPU's statistics: keep the estimate
            peak = self._paces[what].bytes_per_item * items if what in self._paces else 0
        # A chunk's peak and time include what does not grow with its items (the intervals a pass reads): the
        # largest chunk measured says the most about one item.
        if what not in self._paces or items >= self._paces[what].items:
            self._paces[what] = _Pace(peak / items, seconds / items, items)
        self._read_at = None

    def check_time_for(self, what: str, items: int) -> None:
        """Raise :class:`DeadlineExceeded` (agreed over the group) if ``items`` more items of ``what``, at the
        pace of the largest chunk of it measured, would end past the deadline: such a chunk is not started."""
        pace = self._paces.get(what)
        needed = pace.seconds_per_item * items if pace is not None else 0.0
        if agree(time.monotonic() + needed > self.deadline):
            raise DeadlineExceeded


def _in_use(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return _status_bytes("VmRSS:") or 0


def peak_resident_bytes() -> int:
    """The process's resident high-water mark since it started (``VmHWM``; 0 where the OS does not say)."""
    return _status_bytes("VmHWM:") or 0


_budgets: list[Budget] = []


def current_budget() -> Budget | None:
    """The budget of the run in progress (:meth:`Budget.using`), or ``None`` outside any: passes then run whole."""
    return _budgets[-1] if _budgets else None


def seconds_left() -> float:
    """Seconds to the current budget's deadline (infinite outside a budget)."""
    budget = current_budget()
    return math.inf if budget is None else budget.seconds_left()


def time_is_up() -> bool:
    """Whether the current budget's deadline has passed, on any rank of the current group (never outside a
    budget)."""
    budget = current_budget()
    return past(None if budget is None else budget.deadline)


def check_deadline() -> None:
    """Raise :class:`~lightning_fedshard.verify.shard.lockstep.DeadlineExceeded` (agreed over the group) once the
    deadline has passed: between passes."""
    if time_is_up():
        raise DeadlineExceeded


def check_deadline_between_steps() -> None:
    """:func:`check_deadline` inside a bound pass, for a rank that takes its decisions alone: there it is a clock
    read. Ranks in lockstep check between passes only (an agreement per operator step would double the
    collectives of a sharded pass)."""
    if alone() and seconds_left() < 0:
        raise DeadlineExceeded


def run_in_chunks(what: str, count: int, estimate: float, bound: Callable[[slice], T]) -> list[T]:
    """``bound`` over ``count`` items in as few chunks as the current budget allows (one, outside a budget or when
    the ``estimate`` bytes per item fit): the results of the chunks in order. Between chunks the deadline is kept:
    a chunk the measured pace says would end past it is not started (:class:`DeadlineExceeded`)."""
    budget = current_budget()
    if budget is None:
        return [bound(slice(0, count))]
    items = budget.items_per_chunk(what, count, estimate)
    if items >= count and what not in budget._paces:
        return [bound(slice(0, count))]
    results, done = [], 0
    while done < count:
        items = min(items, count - done)
        budget.check_time_for(what, items)
        with budget.measuring(what, items):
            results.append(bound(slice(done, done + items)))
        done += items
        if done < count:
            items = budget.items_per_chunk(what, count - done, estimate)
    return results
