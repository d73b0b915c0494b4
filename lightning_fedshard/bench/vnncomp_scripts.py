"""The VNN-COMP scripts (``vnncomp/run_instance.sh``) run as the competition's runner runs them, next to a plain
``fedshard verify`` of the same instance: verdicts against ``expected_verdicts.csv``, and the wall time each takes.

    python -m lightning_fedshard.bench vnncomp-scripts ../shared/vnncomp/acasxu_2022/instances.csv --rows 0 37 74

(``fedshard bench vnncomp-scripts ...`` is the same.) For each chosen row of ``instances.csv`` (default: all), as
``run_single_instance.sh`` does: the ``.onnx.gz`` gunzipped into a scratch folder, ``prepare_instance.sh`` (untimed,
its exit status shown), ``no_result_in_file`` written into the results file, then ``run_instance.sh`` under
``timeout TIMEOUT+60``, timed as a whole, its verdict the results file's first line. Right after it (then before
it, alternating pair by pair, so that neither always finds the caches warmer) the same instance runs as
``fedshard verify ONNX VNNLIB --timeout TIMEOUT --result FILE``. ``overhead`` is the script's wall time minus the
plain run's, per pair; the medians of the overheads and of the ratios close the table. Both use the ``fedshard``
the scripts find: on PATH (this interpreter's folder is put first), else the repository's ``.venv``; ``--verify-args``
go to both (to the script as ``FEDSHARD_VERIFY_ARGS``). The search's own time varies with the machine's load far more
than the script adds, so the table starts with the wrapper alone: run_instance.sh over a stub ``fedshard`` that only
writes ``unknown``, against the stub by itself (median of 20 each).
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_fedshard.verify.instances import Instance, read_expected, read_instances

__all__ = ["SCRIPTS", "main", "runner_env"]

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "vnncomp"
#: The runner kills run_instance.sh this many seconds after the instance's timeout.
KILL_AFTER_S = 60


def runner_env() -> dict[str, str]:
    """The scripts' environment: this interpreter's folder first on PATH (its ``fedshard``), this checkout first on
    PYTHONPATH."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath}


def wrapper_overhead(repeats: int = 20) -> tuple[float, float]:
    """Median wall seconds of run_instance.sh over a stub ``fedshard`` (it writes ``unknown`` to its ``--result``),
    and of the stub run by itself: what the bash around the one Python process costs."""
    with tempfile.TemporaryDirectory() as scratch:
        stub = Path(scratch) / "fedshard"
        stub.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = --result ] && echo unknown >"$2"; shift; done\n')
        stub.chmod(0o755)
        env = {**os.environ, "PATH": os.pathsep.join([scratch, os.environ.get("PATH", "")])}
        results = str(Path(scratch) / "results.txt")
        script = [str(SCRIPTS / "run_instance.sh"), "v1", "category", "a.onnx", "b.vnnlib", results, "60"]
        plain = [str(stub), "verify", "a.onnx", "b.vnnlib", "--timeout", "60", "--result", results]
        walls: dict[str, list[float]] = {"script": [], "plain": []}
        for _ in range(repeats):
            for name, command in (("script", script), ("plain", plain)):
                walls[name].append(_timed(command, env, 60)[0])
        return statistics.median(walls["script"]), statistics.median(walls["plain"])


def _timed(command: list[str], env: dict[str, str], limit: float) -> tuple[float, int]:
    start = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, check=False, timeout=limit + 30)
    return time.monotonic() - start, done.returncode


def _first_line(path: Path) -> str:
    lines = path.read_text().splitlines() if path.is_file() else []
    return lines[0].strip() if lines else ""


def run_pair(instance: Instance, env: dict[str, str], script_first: bool, verify_args: list[str]) -> dict[str, object]:
    """One instance through prepare_instance.sh and run_instance.sh, and as a plain ``fedshard verify``."""
    fedshard = shutil.which("fedshard", path=env["PATH"]) or str(REPO / ".venv" / "bin" / "fedshard")
    with tempfile.TemporaryDirectory() as scratch:
        onnx = Path(scratch) / instance.onnx.name.removesuffix(".gz")
        raw = instance.onnx.read_bytes()
        onnx.write_bytes(gzip.decompress(raw) if instance.onnx.name.endswith(".gz") else raw)
        args = ["v1", "category", str(onnx), str(instance.vnnlib)]
        prepare_s, prepare_status = _timed([str(SCRIPTS / "prepare_instance.sh"), *args], env, 600)
        script_results, plain_results = Path(scratch) / "script.txt", Path(scratch) / "plain.txt"
        timeout = f"{instance.timeout:g}"
        limit = instance.timeout + KILL_AFTER_S
        script = ["timeout", f"{limit:g}", str(SCRIPTS / "run_instance.sh"), *args, str(script_results), timeout]
        plain = [fedshard, "verify", str(onnx), str(instance.vnnlib), "--timeout", timeout, "--result"]
        plain += [str(plain_results), *verify_args]
        walls = {}
        for name in ("script", "plain") if script_first else ("plain", "script"):
            if name == "script":
                script_results.write_text("no_result_in_file\n")
            walls[name] = _timed(
                script if name == "script" else plain, {**env, "FEDSHARD_VERIFY_ARGS": " ".join(verify_args)}, limit
            )
        return {
            "prepare": f"{prepare_s:.2f} ({prepare_status})",
            "script_s": walls["script"][0],
            "script_status": walls["script"][1],
            "script": _first_line(script_results),
            "plain_s": walls["plain"][0],
            "plain": _first_line(plain_results) or f"exit {walls['plain'][1]}",
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench vnncomp-scripts", description=__doc__.split("\n\n")[0])
    parser.add_argument("instances", type=Path, help="a VNN-COMP instances.csv")
    parser.add_argument("--rows", type=int, nargs="+", help="0-based rows of instances.csv (default: all)")
    parser.add_argument("--verify-args", default="", help='flags for both runs, e.g. "--threads 1"')
    args = parser.parse_args(argv)
    instances = read_instances(args.instances)
    rows = args.rows if args.rows is not None else range(len(instances))
    expected_path = args.instances.parent / "expected_verdicts.csv"
    expected = read_expected(expected_path) if expected_path.is_file() else {}
    env = runner_env()
    script_s, stub_s = wrapper_overhead()
    print(
        f"wrapper alone: run_instance.sh {script_s * 1e3:.1f} ms, the stub by itself {stub_s * 1e3:.1f} ms (medians of 20)"
    )
    print(
        f"{'instance':<46}{'T s':>6}{'expected':>9}{'prepare s':>11}{'script':>9}{'exit':>5}{'wall s':>8}"
        f"{'plain':>9}{'wall s':>8}{'overhead s':>11}"
    )
    overheads, ratios = [], []
    for pair, row in enumerate(rows):
        instance = instances[row]
        result = run_pair(instance, env, pair % 2 == 0, args.verify_args.split())
        overhead = result["script_s"] - result["plain_s"]
        overheads.append(overhead)
        ratios.append(result["script_s"] / result["plain_s"])
        label = f"{instance.onnx.name.removesuffix('.onnx.gz').removesuffix('.onnx')} {instance.vnnlib.stem}"
        want = expected.get((instance.onnx.name, instance.vnnlib.name), "") or "-"
        print(
            f"{label[:45]:<46}{instance.timeout:>6g}{want:>9}{result['prepare']:>11}{result['script']:>9}"
            f"{result['script_status']:>5}{result['script_s']:>8.2f}{result['plain']:>9}{result['plain_s']:>8.2f}"
            f"{overhead:>+11.2f}",
            flush=True,
        )
    print(
        f"median overhead {statistics.median(overheads):+.3f} s, median script/plain {statistics.median(ratios):.3f} "
        f"over {len(overheads)} instance(s)"
    )


if __name__ == "__main__":
    main()
