"""The processes of a run, as a failed rank ends them; also a script, ``python processes.py GRACE PID:START ...``.

Standard library only: :class:`~lightning_fedshard.distributed.JobEnd` runs this file as a short-lived watcher
process, which must start fast and outlive the rank that launched it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunProcess", "end_processes"]

_KILL = getattr(signal, "SIGKILL", signal.SIGTERM)


@dataclass(frozen=True)
class RunProcess:
    """One process of a run: the machine it runs on, its pid, and its start time, so that a recycled pid is
    never taken for it."""

    machine: str
    pid: int
    start_time: str | None
    """Clock ticks since boot (``/proc/<pid>/stat``); ``None`` where there is no ``/proc``."""

    @classmethod
    def of(cls, pid: int) -> RunProcess:
        """The process ``pid`` on this machine (host name and boot id)."""
        boot_id = (_read(Path("/proc/sys/kernel/random/boot_id")) or "").strip()
        fields = _stat_fields(pid)
        return cls(f"{socket.gethostname()}/{boot_id}", pid, fields[19] if fields else None)

    @classmethod
    def this(cls) -> RunProcess:
        return cls.of(os.getpid())

    def state(self) -> str | None:
        """Its state letter (``"T"`` stopped, ``"Z"`` exited but not yet reaped, ...), ``None`` once it is gone."""
        if self.start_time is None:
            try:
                os.kill(self.pid, 0)
            except (ProcessLookupError, PermissionError):
                return None
            return "R"
        fields = _stat_fields(self.pid)
        if not fields or fields[19] != self.start_time:
            return None
        return fields[0]

    def kill(self) -> None:
        try:
            os.kill(self.pid, _KILL)
        except ProcessLookupError:
            pass


def end_processes(processes: list[RunProcess], grace_s: float) -> None:
    """Waits up to ``grace_s`` for ``processes`` to end by themselves, killing a stopped one at once (it cannot
    end by itself) and the others still running once the grace period is over."""
    deadline = time.monotonic() + grace_s
    while processes:
        states = {p: p.state() for p in processes}
        alive = [p for p, state in states.items() if state is not None and state not in ("Z", "X")]
        out_of_time = time.monotonic() >= deadline
        ending = [p for p in alive if out_of_time or states[p] in ("T", "t")]
        for process in ending:
            how = "stopped" if states[process] in ("T", "t") else f"still running after {grace_s:g} s"
            print(f"[run ending] killing process {process.pid} of the failed run ({how})", file=sys.stderr, flush=True)
            process.kill()
        processes = [p for p in alive if p not in ending]
        if processes:
            time.sleep(0.1)


def _stat_fields(pid: int) -> list[str]:
    """Fields 3… of ``/proc/<pid>/stat`` (the state first); the command name before them may hold spaces."""
    text = _read(Path(f"/proc/{pid}/stat"))
    return text.rsplit(")", 1)[1].split() if text else []


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


if __name__ == "__main__":
    grace, *records = sys.argv[1:]
    end_processes(
        [RunProcess("", int(pid), None if start == "-" else start) for pid, start in (r.split(":") for r in records)],
        float(grace),
    )
