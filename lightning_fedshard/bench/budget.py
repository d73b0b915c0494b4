"""Whether ``fedshard verify`` keeps its memory budget and its deadline on large nets: two processes side by side,
each ``fedshard verify ONNX VNNLIB --memory GIB --timeout T --threads 1``, on the large synthetic nets built here
(:mod:`~lightning_fedshard.bench.large_nets`) and on the largest network of every VNN-COMP set.

    python -m lightning_fedshard.bench budget [--memory 2 4 8] [--timeouts 10 30 60] [--nets generator ...]
                                              [--sets mnist_fc ...] [--root ../shared/vnncomp]

(``fedshard bench budget ...`` is the same.) Budgets are swept at the middle timeout and timeouts at the middle
budget. Per run it prints the answer, the resident peak over the budget plus the interpreter's own resident set
(``peak / (budget + base)``: at most 1 is a kept promise), the wall time over the timeout (start-up included:
``wall − T`` at most 1 s is kept), and whether a process was killed or an allocation failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_fedshard.bench.deadlines import KILL_AFTER_S, slowest_instance
from lightning_fedshard.bench.gpu_check import REPO, vnncomp_root
from lightning_fedshard.bench.large_nets import LARGE_NETS, export_net

__all__ = ["Run", "interpreter_bytes", "main", "run_pair"]

GIB = 1 << 30


@dataclass
class Run:
    """One ``fedshard verify`` process: its answer (``killed``, ``exit N`` where it ended without one), wall
    seconds, resident peak bytes (its report's; 0 without one) and the reason of an ``unknown``."""

    answer: str
    wall: float
    peak: int
    reason: str


def interpreter_bytes() -> int:
    """The resident set of a process that has imported the verifier and nothing else: the base every budget sits
    on top of."""
    code = "import resource, lightning_fedshard.verify.cli; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) * 1024


def run_pair(onnx: Path, vnnlib: Path, memory: float, timeout: float) -> list[Run]:
    """The same instance in two processes started together (each with its own budget of ``memory`` GiB)."""
    with tempfile.TemporaryDirectory() as folder:
        reports = [Path(folder) / f"report{i}.json" for i in range(2)]
        start = time.monotonic()
        processes = []
        for report in reports:
            command = [sys.executable, "-m", "lightning_fedshard.cli", "verify", str(onnx), str(vnnlib)]
            command += ["--timeout", str(timeout), "--memory", str(memory), "--threads", "1", "--report", str(report)]
            processes.append(
                subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            )
        runs = []
        for process, report in zip(processes, reports, strict=True):
            try:
                out, _ = process.communicate(timeout=max(1.0, start + timeout + KILL_AFTER_S - time.monotonic()))
                wall = time.monotonic() - start
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                runs.append(Run("killed", time.monotonic() - start, 0, "past the timeout by a minute"))
                continue
            data = json.loads(report.read_text()) if report.is_file() else {}
            words = out.split()
            answer = words[0] if process.returncode in (0, 2) and words else f"exit {process.returncode}"
            runs.append(Run(answer, wall, int(data.get("rss_peak_bytes", 0)), data.get("reason", "")))
    return runs


def _instances(args: argparse.Namespace, folder: Path) -> list[tuple[str, Path, Path]]:
    instances = [(name, *export_net(name, folder)) for name in args.nets]
    if args.sets != []:
        root = vnncomp_root(None if args.root is None else str(args.root))
        if root is not None and root.is_dir():
            sets = args.sets or sorted(p.name for p in root.iterdir() if (p / "instances.csv").is_file())
            instances += [(name, *slowest_instance(root / name)) for name in sets]
    return instances


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench budget", description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory", type=float, nargs="+", default=[2.0, 4.0, 8.0], help="budgets in GiB")
    parser.add_argument("--timeouts", type=float, nargs="+", default=[10.0, 30.0, 60.0])
    parser.add_argument("--nets", nargs="*", default=list(LARGE_NETS), choices=list(LARGE_NETS))
    parser.add_argument("--sets", nargs="*", default=None, help="VNN-COMP sets (default: all; none: --sets)")
    parser.add_argument("--root", type=Path, default=None, help="folder of the VNN-COMP sets (default: found)")
    args = parser.parse_args(argv)
    if any(m <= 0 for m in args.memory) or any(t <= 0 for t in args.timeouts):
        parser.error("--memory and --timeouts must be positive")
    middle_memory = sorted(args.memory)[len(args.memory) // 2]
    middle_timeout = sorted(args.timeouts)[len(args.timeouts) // 2]
    grid = [(m, middle_timeout) for m in args.memory] + [
        (middle_memory, t) for t in args.timeouts if t != middle_timeout
    ]
    base = interpreter_bytes()
    print(f"interpreter: {base / GIB:.2f} GiB resident; two processes side by side per row", flush=True)
    print(f"{'net':<22}{'GiB':>5}{'T':>5}  {'answers':<18}{'peak GiB':>16}{'peak/(budget+base)':>20}{'wall-T':>14}")
    worst_memory, worst_time, failures = 0.0, -1e9, 0
    with tempfile.TemporaryDirectory() as folder:
        for name, onnx, vnnlib in _instances(args, Path(folder)):
            for memory, timeout in grid:
                runs = run_pair(onnx, vnnlib, memory, timeout)
                ratio = max(run.peak / (memory * GIB + base) for run in runs)
                over = max(run.wall - timeout for run in runs)
                worst_memory, worst_time = max(worst_memory, ratio), max(worst_time, over)
                broken = [r for r in runs if r.answer in ("killed", "error") or r.answer.startswith("exit")]
                broken += [r for r in runs if "out of memory" in r.reason or "internal error" in r.reason]
                failures += len(broken)
                answers = "/".join(run.answer for run in runs)
                peaks = "/".join(f"{run.peak / GIB:.2f}" for run in runs)
                print(
                    f"{name[:21]:<22}{memory:>5g}{timeout:>5g}  {answers:<18}{peaks:>16}{ratio:>20.2f}{over:>+14.2f}",
                    flush=True,
                )
                for run in runs:
                    if run.reason:
                        print(f"{'':<22}reason: {run.reason[:150]}")
    print(f"worst peak/(budget+base) {worst_memory:.2f}, worst wall-T {worst_time:+.2f} s, {failures} killed/failed")


if __name__ == "__main__":
    main()
