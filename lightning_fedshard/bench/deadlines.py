"""Whether ``fedshard verify`` keeps its timeout: the wall time of a whole process (start-up included, as VNN-COMP
counts it) against ``--timeout``, on one instance of every VNN-COMP set.

    python -m lightning_fedshard.bench deadlines [--root ../shared/vnncomp] [--timeouts 5 10 20 30] [--sets ...]

(``fedshard bench deadlines ...`` is the same.) Per set it runs the instance of ``instances.csv`` with the largest
network file (the longest single bound pass and attack step; ties to the larger official timeout) as
``fedshard verify ONNX VNNLIB --timeout T --threads 1`` for each ``T``, and prints the wall time of each run and
``max(wall − T)`` per set: a positive value is a broken promise. ``start-up`` is the most, over the runs, of
the wall time the verifier itself did not count (interpreter, imports, exit): what no phase's check can win back.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_fedshard.bench.gpu_check import REPO, vnncomp_root

__all__ = ["main", "overrun", "slowest_instance"]

TIMEOUTS = (5.0, 10.0, 20.0, 30.0)
#: Seconds past its timeout after which a run is killed (and recorded with the wall time it had then).
KILL_AFTER_S = 60.0


def slowest_instance(folder: Path) -> tuple[Path, Path]:
    """``(onnx, vnnlib)`` of the row of ``folder/instances.csv`` with the largest network file (then the largest
    official timeout): the instance whose single passes take longest."""
    path = folder / "instances.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no instances.csv in this VNN-COMP set")
    with path.open(newline="") as handle:
        rows = [row for row in csv.reader(handle) if len(row) >= 2 and not row[0].startswith("#")]
    if not rows:
        raise ValueError(f"{path}: no instances")
    row = max(rows, key=lambda r: ((folder / r[0]).stat().st_size, float(r[2]) if len(r) > 2 else 0.0))
    return folder / row[0], folder / row[1]


def run_once(onnx: Path, vnnlib: Path, timeout: float) -> tuple[float, float, str]:
    """Wall seconds of one ``fedshard verify`` process at ``timeout`` (start-up included), the seconds of it
    outside the verifier's own phases (its report's ``total_time_s``), and its answer."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        command = [sys.executable, "-m", "lightning_fedshard.cli", "verify", str(onnx), str(vnnlib)]
        command += ["--timeout", str(timeout), "--threads", "1", "--report", str(report)]
        start = time.monotonic()
        try:
            done = subprocess.run(
                command, check=False, cwd=REPO, capture_output=True, text=True, timeout=timeout + KILL_AFTER_S
            )
        except subprocess.TimeoutExpired:
            wall = time.monotonic() - start
            return wall, wall, "killed"
        wall = time.monotonic() - start
        searched = json.loads(report.read_text())["total_time_s"] if report.is_file() else 0.0
    words = done.stdout.split()
    return wall, wall - searched, words[0] if done.returncode in (0, 2) and words else f"exit {done.returncode}"


def overrun(walls: dict[float, float]) -> float:
    """``max(wall − timeout)`` over the runs ``{timeout: wall}`` of one set."""
    return max(wall - timeout for timeout, wall in walls.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench deadlines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=None, help="folder of the VNN-COMP sets (default: found)")
    parser.add_argument("--timeouts", type=float, nargs="+", default=list(TIMEOUTS))
    parser.add_argument("--sets", nargs="+", default=None, help="set folders to run (default: all)")
    args = parser.parse_args(argv)
    if any(t <= 0 for t in args.timeouts):
        parser.error("--timeouts must be positive")
    root = vnncomp_root(None if args.root is None else str(args.root))
    root = args.root if root is None and args.root is not None else root
    if root is None or not root.is_dir():
        parser.error("no VNN-COMP folder: give --root (or set $FEDSHARD_VNNCOMP)")
    sets = args.sets or sorted(p.name for p in root.iterdir() if (p / "instances.csv").is_file())
    header = "".join(f"{f'T={t:g}':>16}" for t in args.timeouts)
    print(f"{'set':<24}{'instance':<44}{header}{'max(wall-T)':>13}{'start-up':>10}")
    for name in sets:
        onnx, vnnlib = slowest_instance(root / name)
        walls, cells, startup = {}, [], 0.0
        for timeout in args.timeouts:
            wall, outside, answer = run_once(onnx, vnnlib, timeout)
            walls[timeout], startup = wall, max(startup, outside)
            cells.append(f"{wall:7.2f} {answer:>8}")
        label = f"{onnx.name} {vnnlib.name}"
        print(
            f"{name:<24}{label[:43]:<44}{''.join(f'{c:>16}' for c in cells)}{overrun(walls):>+13.2f}{startup:>10.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
