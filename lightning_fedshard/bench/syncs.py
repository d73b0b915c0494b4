"""``fedshard bench syncs``: the host synchronisations of verifying an instance, per phase, per branch-and-bound
round and per call site (:class:`~lightning_fedshard.verify.syncs.SyncCounter`). On a CPU it counts what would make
a CUDA run wait; each one costs a GPU run at least the launch latency of the kernels queued before it.

    fedshard bench syncs                                   # the instances of `make gpu-check`'s verify check
    fedshard bench syncs --instance NET.onnx PROP.vnnlib   # one instance
    fedshard bench syncs --device cuda --top 12            # on a GPU: only tensors on the GPU count
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

__all__ = ["count_syncs", "main"]


def count_syncs(onnx: Path, vnnlib: Path, device: str = "cpu", timeout: float = 20.0):
    """Verifies the instance under a :class:`SyncCounter`; returns ``(result, counter, seconds)``."""
    from lightning_fedshard.verify import VerifyConfig, verify_files
    from lightning_fedshard.verify.syncs import SyncCounter

    config = VerifyConfig(timeout=timeout, device=device)
    start = time.monotonic()
    with SyncCounter() as counter:
        result = verify_files(onnx, vnnlib, config)
    return result, counter, time.monotonic() - start


def _report(name: str, result, counter, seconds: float, top: int) -> None:
    print(f"\n{name}: {result.verdict.value} ({result.decided_by}), {seconds:.2f} s, {counter.total} syncs")
    print(f"  {'phase':<12} {'syncs':>8} {'seconds':>8} {'rounds':>7} {'syncs/round':>12}")
    for phase, n in counter.by_phase().items():
        rounds = counter.rounds.get(phase, 0)
        per_round = f"{n / rounds:.1f}" if rounds else "-"
        print(f"  {phase:<12} {n:>8} {result.times.get(phase, 0.0):>8.2f} {rounds:>7} {per_round:>12}")
    for site, kind, n in counter.top(top):
        print(f"    {n:>7} {kind:<6} {site}")


def main(argv: list[str] | None = None) -> None:
    from lightning_fedshard.bench.gpu_check import VERIFY_INSTANCES, vnncomp_root

    parser = argparse.ArgumentParser(prog="fedshard bench syncs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--instance", nargs=2, metavar=("ONNX", "VNNLIB"), help="one instance (default: gpu-check's)")
    parser.add_argument("--vnncomp", help="the folder of the VNN-COMP sets (default: as gpu-check finds it)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per instance")
    parser.add_argument("--top", type=int, default=8, help="call sites listed per instance")
    args = parser.parse_args(argv)
    if args.instance:
        instances = [(Path(args.instance[0]), Path(args.instance[1]))]
    else:
        root = vnncomp_root(args.vnncomp)
        if root is None:
            raise SystemExit("no VNN-COMP folder: give --vnncomp or --instance")
        instances = [(root / s / onnx, root / s / prop) for s, onnx, prop, *_ in VERIFY_INSTANCES]
    totals = []
    for onnx, vnnlib in instances:
        result, counter, seconds = count_syncs(onnx, vnnlib, args.device, args.timeout)
        name = f"{onnx.name.split('.')[0]} {vnnlib.stem}"
        _report(name, result, counter, seconds, args.top)
        totals.append((name, result.verdict.value, seconds, counter.total))
    print(f"\n{'instance':<40} {'verdict':>8} {'seconds':>8} {'syncs':>8}")
    for name, verdict, seconds, total in totals:
        print(f"{name:<40} {verdict:>8} {seconds:>8.2f} {total:>8}")
