"""Where an optimizer step's wall time goes, per rank: compute, collectives, a fragment average's send, wait, apply.

:class:`StepProfiler` is a Lightning callback with a clock of its own. Its hooks cut every training step into
consecutive parts (between steps: loading the batch and the loop; forward, backward, optimizer, other), and it
wraps the calls made inside those parts: the synchronous ``torch.distributed`` collectives (FSDP's all-gathers and
reduce-scatters, HSDP's all-reduce), and a federated strategy's fragment averages (sending one, waiting for it at
its due step, applying it). A wrapped call's time is taken out of the part it was made in, so the parts add up to
the steps' wall time exactly. Beside the wall time each part carries the main thread's CPU time
(``time.thread_time``): a part whose CPU time is much smaller than its wall time waited, for the network or for a
core. At the end the rank's totals, the CPU time of each of its threads (the main thread against gloo's) and how
busy each core of the machine was (``/proc/stat``) go to a JSON file per rank.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

__all__ = [
    "PARTS",
    "StepProfiler",
    "cpu_times",
    "format_by_position",
    "format_profiles",
    "mean_profile",
    "read_profiles",
]

#: The parts of a step, in the order the table shows them.
PARTS = (
    "between steps",
    "forward",
    "backward",
    "optimizer",
    "collectives",
    "fragment send",
    "fragment wait",
    "fragment apply",
    "other",
)
#: Synchronous collectives counted as "collectives" (FSDP2 calls the ``*_single`` ones).
_COLLECTIVES = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
    "barrier",
    "all_gather",
)
#: A streaming average's parts; the collectives inside them belong to them, not to "collectives".
_FRAGMENT_PARTS = ("fragment send", "fragment wait", "fragment apply")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


class _Clock:
    """Exclusive time per part: the time between two marks goes to the innermost part open at the time."""

    def __init__(self) -> None:
        self.stack = ["other"]
        self.running = False
        self.reset()

    def _charge(self) -> None:
        now = (time.perf_counter(), time.thread_time())
        if self.running:
            part = self.stack[-1]
            self.wall[part] += now[0] - self._since[0]
            self.cpu[part] += now[1] - self._since[1]
        self._since = now

    def switch(self, part: str) -> None:
        """The outermost part becomes ``part`` from now on."""
        self._charge()
        self.stack[0] = part

    def run(self, running: bool) -> None:
        """Starts or stops counting from now; the time since the last mark is dropped (it is no step's: the loop
        between the last step and validation or the end of training)."""
        self.running = running
        self._since = (time.perf_counter(), time.thread_time())

    def reset(self) -> None:
        """Forgets what was counted; counts on from now."""
        self.wall = dict.fromkeys(PARTS, 0.0)
        self.cpu = dict.fromkeys(PARTS, 0.0)
        self.run(self.running)

    @contextmanager
    def inside(self, part: str) -> Iterator[None]:
        self._charge()
        self.stack.append(part)
        try:
            yield
        finally:
            self._charge()
            self.stack.pop()


class StepProfiler(Callback):
    """Breaks each training step's wall time into :data:`PARTS` and writes the totals of rank ``r`` to
    ``<directory>/rank<r>.json``: ``{"steps", "wall": {part: s}, "cpu": {part: s}, "threads": {name: s},
    "core_busy"/"core_kernel": [fraction per core], "per_step": {step: {part: s}}, "preempted": {step: n}}``
    (threads: CPU seconds of each thread of the rank's process; core_kernel: the part of the time spent in the
    kernel, network stack included; preempted: the main thread's involuntary context switches).

    The first ``skip_steps`` steps (start-up: first all-gathers, allocator warm-up) are not counted; neither is
    validation. The wrappers cost two clock reads per collective.

    Example::

        trainer = Trainer(callbacks=[StepProfiler("runs/profile")], ...)
        # after fit: read_profiles("runs/profile") -> one dict per rank; mean_profile(...) -> seconds per step
    """

    def __init__(self, directory: str, skip_steps: int = 2) -> None:
        self.directory = Path(directory)
        self.skip_steps = skip_steps
        self.clock = _Clock()
        self._restore: list[Callable[[], None]] = []
        self._threads_at_start: dict[str, float] = {}
        self._core_ticks: list[tuple[int, ...]] | None = None
        """Per core, :func:`cpu_times`' ticks while the steps were counted."""
        self._core_mark: list[tuple[int, ...]] = []
        self.per_step: dict[int, dict[str, float]] = {}
        """Wall seconds per part of each counted step, by optimizer step."""
        self._wall_at_last_step: dict[str, float] = {}
        self.preempted: dict[int, int] = {}
        """Times the main thread was preempted (switched out while runnable) in each counted step."""
        self._preempted_at_last_step = 0

    # ---- wrapping ----------------------------------------------------------------------------------------

    def _wrap(self, owner: Any, name: str, part: str, only_outside: Sequence[str] = ()) -> None:
        """Replaces ``owner.name`` by a call timed as ``part`` (left to the enclosing part when that is one of
        ``only_outside``, or when the call is asynchronous: its time is then spent where it is waited for)."""
        original = getattr(owner, name)
        clock = self.clock

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if clock.stack[-1] in only_outside or kwargs.get("async_op"):
                return original(*args, **kwargs)
            with clock.inside(part):
                return original(*args, **kwargs)

        setattr(owner, name, timed)
        self._restore.append(lambda: setattr(owner, name, original))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name in _COLLECTIVES:
            self._wrap(dist, name, "collectives", only_outside=_FRAGMENT_PARTS)
        # the federated strategies' averager (None for the other strategies, and for fl_* with one group)
        averager = getattr(trainer.strategy, "_averager", None)
        if averager is not None:
            self._wrap(averager, "start", "fragment send")
            self._wrap(averager, "complete", "fragment wait")
            self._wrap(averager, "finish", "fragment apply")  # its complete() is timed as the wait inside it
        self._threads_at_start = _thread_cpu_seconds()
        self.clock.run(True)

    # ---- the step's parts --------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.clock.switch("forward")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self.clock.switch("backward")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.clock.switch("other")

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.clock.switch("optimizer")  # gradient clipping, the optimizer, then the strategy's sync after it

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.clock.switch("between steps")  # loading the next batch, the loop, other callbacks, logging
        if trainer.global_step == self.skip_steps:
            self.clock.reset()
            self._threads_at_start = _thread_cpu_seconds()
            self._core_mark = cpu_times()
            self._core_ticks = [(0, 0, 0)] * len(self._core_mark)
        elif trainer.global_step > self.skip_steps:
            last = self._wall_at_last_step
            self.per_step[trainer.global_step] = {p: s - last.get(p, 0.0) for p, s in self.clock.wall.items()}
        self._wall_at_last_step = dict(self.clock.wall)
        preempted = _main_thread_preemptions()
        if trainer.global_step > self.skip_steps:
            self.preempted[trainer.global_step] = preempted - self._preempted_at_last_step
        self._preempted_at_last_step = preempted

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # validation inside fit, not a trainer.validate()
            self._count(False)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._count(True)

    def _count(self, counting: bool) -> None:
        """Starts or stops counting: the step clock, and the cores' ticks once the skipped steps are over."""
        self.clock.run(counting)
        if counting:
            self._core_mark = cpu_times()
        elif self._core_ticks is not None and self._core_mark:
            now = cpu_times()
            self._core_ticks = [
                tuple(sum_ + b - a for sum_, a, b in zip(ticks, mark, new, strict=True))
                for ticks, mark, new in zip(self._core_ticks, self._core_mark, now, strict=True)
            ]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._count(False)
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()
        now = _thread_cpu_seconds()
        threads = {name: now[name] - self._threads_at_start.get(name, 0.0) for name in now}
        ticks = self._core_ticks or []
        record = {
            "steps": len(self.per_step),
            "wall": self.clock.wall,
            "cpu": self.clock.cpu,
            "threads": threads,
            "core_busy": [busy / max(total, 1) for busy, _, total in ticks],
            "core_kernel": [kernel / max(total, 1) for _, kernel, total in ticks],
            "per_step": self.per_step,
            "preempted": self.preempted,
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))


def _main_thread_preemptions() -> int:
    """How often the main thread was switched out while it could have run on (a core taken by another thread)."""
    for line in Path(f"/proc/self/task/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise RuntimeError("no nonvoluntary_ctxt_switches in /proc/self/task/<pid>/status")


def _thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of each of this process's threads, by ``name:tid`` (the main thread: ``main``)."""
    seconds = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        key = "main" if int(task.name) == os.getpid() else f"{name}:{task.name}"
        seconds[key] = (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime
    return seconds


# ---- reading the ranks' records ---------------------------------------------------------------------------


def read_profiles(directory: Path) -> list[dict[str, Any]]:
    """The records every rank's :class:`StepProfiler` wrote to ``directory``, by rank."""
    files = sorted(directory.glob("rank*.json"), key=lambda f: int(f.stem.removeprefix("rank")))
    if not files:
        raise FileNotFoundError(f"no rank*.json profile in {directory}")
    return [json.loads(f.read_text()) for f in files]


def mean_profile(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Seconds per step, averaged over the ranks: ``wall``/``cpu`` per part, ``step`` (their sum: the step's wall
    time), the CPU seconds of the main thread and of all other threads (gloo's among them) per step, and each
    core's busy fraction while the steps ran (``core_busy``, of it in the kernel ``core_kernel``: rank 0's reading),
    ``per_step``: the parts' wall seconds of each counted optimizer step, and ``preempted``: how often the main
    thread was preempted in each."""
    per_step = [
        {
            "wall": {part: r["wall"][part] / r["steps"] for part in PARTS},
            "cpu": {part: r["cpu"][part] / r["steps"] for part in PARTS},
            "main thread cpu": r["threads"]["main"] / r["steps"],
            "other threads cpu": sum(s for name, s in r["threads"].items() if name != "main") / r["steps"],
        }
        for r in records
    ]
    n = len(per_step)
    mean = {kind: {part: sum(p[kind][part] for p in per_step) / n for part in PARTS} for kind in ("wall", "cpu")}
    for key in ("main thread cpu", "other threads cpu"):
        mean[key] = sum(p[key] for p in per_step) / n
    mean["step"] = sum(mean["wall"].values())
    mean["steps"] = min(r["steps"] for r in records)
    mean["core_busy"] = records[0]["core_busy"]  # the machine's cores: the same for every rank
    mean["core_kernel"] = records[0]["core_kernel"]
    steps = set.intersection(*(set(r["per_step"]) for r in records))
    mean["preempted"] = {int(step): sum(r["preempted"][step] for r in records) / n for step in sorted(steps, key=int)}
    mean["per_step"] = {
        int(step): {part: sum(r["per_step"][step][part] for r in records) / n for part in PARTS}
        for step in sorted(steps, key=int)
    }
    return mean


def format_profiles(profiles: Mapping[str, Mapping[str, Any]]) -> str:
    """One table of :func:`mean_profile` results by run label: wall ms per step and part (the main thread's CPU
    ms beside it), the threads' CPU time, the main thread's preemptions per step, and how busy each core was."""
    labels = list(profiles)
    width = max(18, *(len(label) + 1 for label in labels))
    lines = [
        "ms per optimizer step, mean over ranks: wall (main thread's CPU); parts add up to the step",
        f"{'part':<16}" + "".join(f"{label:>{width}}" for label in labels),
    ]

    def row(name: str, cell: Callable[[Mapping[str, Any]], str]) -> str:
        return f"{name:<16}" + "".join(f"{cell(profiles[label]):>{width}}" for label in labels)

    for part in PARTS:
        lines.append(row(part, lambda p, part=part: f"{1e3 * p['wall'][part]:.1f} ({1e3 * p['cpu'][part]:.1f})"))
    lines.append(row("step", lambda p: f"{1e3 * p['step']:.1f} ({1e3 * sum(p['cpu'].values()):.1f})"))
    lines.append(row("main thr CPU", lambda p: f"{1e3 * p['main thread cpu']:.1f}"))
    lines.append(row("other thr CPU", lambda p: f"{1e3 * p['other threads cpu']:.1f}"))
    lines.append(row("main preempted", lambda p: f"{sum(p['preempted'].values()) / len(p['preempted']):.1f}"))
    lines.append(row("steps counted", lambda p: str(p["steps"])))
    lines.append(row("cores busy", lambda p: " ".join(f"{u:.0%}" for u in p["core_busy"])))
    lines.append(row("  of it kernel", lambda p: " ".join(f"{u:.0%}" for u in p["core_kernel"])))
    return "\n".join(lines)


# ---- the machine's cores ----------------------------------------------------------------------------------


def cpu_times() -> list[tuple[int, int, int]]:
    """Per core, from ``/proc/stat``: (busy, kernel, all) ticks since boot; busy is all but idle and iowait, kernel
    is system, irq and softirq time (the network stack's work, tc's shaping included)."""
    cores = []
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            ticks = [int(f) for f in fields]
            idle = ticks[3] + ticks[4]
            kernel = ticks[2] + ticks[5] + ticks[6]
            cores.append((sum(ticks[:8]) - idle, kernel, sum(ticks[:8])))  # guest time is counted in user already
    return cores


def format_by_position(profiles: Mapping[str, Mapping[str, Any]], period: int, names: Mapping[int, str]) -> str:
    """Wall ms per part of the steps at each position ``step % period`` (a streaming schedule's send and due steps
    come back every ``period`` steps), mean over those steps and the ranks; ``names`` labels positions."""
    shown = ("forward", "backward", "optimizer", "collectives", "fragment send", "fragment wait", "fragment apply")
    lines = [
        f"{'run':<18} {'step % ' + str(period):<22} {'steps':>5} {'wall':>7} "
        + " ".join(f"{p:>9.9}" for p in shown)
        + f" {'preempted':>9}"
    ]
    for label, profile in profiles.items():
        for position in range(period):
            steps = [parts for step, parts in profile["per_step"].items() if step % period == position]
            if not steps:
                continue
            mean = {part: 1e3 * sum(s[part] for s in steps) / len(steps) for part in PARTS}
            preempted = [n for step, n in profile["preempted"].items() if step % period == position]
            where = f"{position} {names.get(position, '')}"
            lines.append(
                f"{label:<18} {where:<22} {len(steps):>5} {sum(mean.values()):7.1f} "
                + " ".join(f"{mean[p]:9.1f}" for p in shown)
                + f" {sum(preempted) / len(preempted):9.1f}"
            )
    return "\n".join(lines)
