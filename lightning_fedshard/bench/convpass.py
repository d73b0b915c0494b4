"""Time of the backward CROWN steps through each convolution, against a dense matmul of the same FLOPs and against
the code of another checkout.

    python -m lightning_fedshard.bench convpass --root ../shared/vnncomp [--networks cifar_biasfield_2022 ...]
        [--rows 512] [--repeats 5] [--baseline ../main]

(``fedshard bench convpass ...`` is the same.) For every ``Conv2d`` node ``s`` of every ``.onnx``/``.onnx.gz`` under
``ROOT/NETWORK/onnx``, the pass the verifier runs to bound ``s``'s neurons with patches: the rows ``±e_i`` of
``--rows / 2`` neurons (as :meth:`Patches.identity` builds them) sent back from ``s`` through every convolution
before it (the ops between them, which keep the windows' geometry, are skipped; the pass follows each node's first
input and stops at an op that takes no patches). Each convolution the pass crosses is one step, timed as
:meth:`Conv2d.backward` with the coefficients that arrive there: ``1 × 1`` windows at ``s`` itself, wider ones
further back, dense ones once the windows cover the image.

A step's exact FLOP count is that of the transposed convolution of its coefficients, ``2 · rows · kH · kW ·
C_out/groups · C_in · k_H · k_W`` (windows ``kH × kW``; the node's ``H × W`` for dense coefficients); the reference
is the matmul ``[rows · kH · kW, C_out/groups] @ [C_out/groups, C_in · k_H · k_W]``, the same multiply-adds as one
dense GEMM, timed in the same run. ``--baseline DIR`` also times every step with the package of the checkout
``DIR`` (a subprocess that runs this file with ``DIR`` first on the path), so that old and new code are compared
in one run. The ``dense ms`` column times the same step on the same coefficients made dense (the evidence for
:data:`~lightning_fedshard.verify.ops.patches.DENSE_FILL`). The table gives the least CPU time of ``--repeats``
timings (run it with ``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from lightning_fedshard.verify import load_onnx
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.ops import Interval
from lightning_fedshard.verify.ops.conv import Conv2d
from lightning_fedshard.verify.ops.patches import Patches

DEFAULT_NETWORKS = ("cifar_biasfield_2022", "verivital_2021")


def step_geometry(A: Tensor | Patches) -> tuple[int, int, int]:
    """``(rows, kH, kW)`` of coefficients ``A`` arriving at ``op``: windows of Patches, the node's image if dense."""
    values = A.values if isinstance(A, Patches) else A
    return values.shape[0] * values.shape[1], values.shape[-2], values.shape[-1]


def conv_step_flops(op: Conv2d, rows: int, window: tuple[int, int] = (1, 1)) -> int:
    """Multiply-adds × 2 of one backward step of ``rows`` rows with ``window`` coefficients per channel."""
    c_out, c_in_per_group, kh, kw = op.weight.shape
    return 2 * rows * window[0] * window[1] * (c_out // op.groups) * c_in_per_group * op.groups * kh * kw


def _best_seconds(step: Callable[[], object], repeats: int) -> float:
    """The least CPU time of the process over ``repeats`` calls of ``step``: on a shared machine the wall time of a
    single-threaded step mostly measures the other processes (a run beside three others took 3.8 min of wall time for
    24 s of its own CPU time), its CPU time does not (page faults are counted, as system time)."""
    step()  # warm-up: allocator and kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        step()
        best = min(best, time.process_time() - start)
    return best


def pass_steps(graph: BoundGraph, start: str, rows: int) -> list[tuple[str, Conv2d, Tensor | Patches]]:
    """``(layer, op, coefficients)`` of every convolution a patches pass from conv node ``start`` crosses."""
    shape = graph.by_name[start].shape
    neurons = min(rows // 2, int(torch.Size(shape).numel()))
    index = torch.linspace(0, torch.Size(shape).numel() - 1, neurons).long()
    A, name, steps = Patches.identity(index, batch=1, shape=shape, dtype=graph.dtype), start, []
    while name in graph.by_name and graph.by_name[name].op is not None:
        node = graph.by_name[name]
        if isinstance(node.op, Conv2d):
            steps.append((name, node.op, A))
            with torch.no_grad():
                A = node.op.transpose(A)
        elif isinstance(A, Patches) and not node.op.accepts_patches:
            break
        name = node.inputs[0]
    return steps


def measure_network(path: Path, rows: int, repeats: int, reference: bool = True) -> list[dict]:
    """One table row per (start convolution, convolution crossed) of the network at ``path``; ``reference``: also
    the matmul of the same FLOPs and the dense step."""
    graph = load_onnx(path)
    results = []
    for start in [node.name for node in graph.nodes if isinstance(node.op, Conv2d)]:
        for layer, op, A in pass_steps(graph, start, rows):
            # The step charges the layer's rounding on its input's magnitude (a unit box here; computed once per pass)
            ones = torch.ones(1, *graph.by_name[graph.by_name[layer].inputs[0]].shape, dtype=graph.dtype)
            inputs = [Interval(-ones, ones)]
            count, kh, kw = step_geometry(A)
            row = {
                "network": path.name,
                "start": start,
                "layer": layer,
                "window": "dense" if not isinstance(A, Patches) else f"{kh}x{kw}",
                "fill": kh * kw / (graph.by_name[layer].shape[1] * graph.by_name[layer].shape[2]),
                "rows": count,
                "flops": conv_step_flops(op, count, (kh, kw)),
                "conv_ms": 1e3 * _best_seconds(lambda op=op, A=A, inputs=inputs: op.backward(A, inputs), repeats),
            }
            if reference:
                c_out, c_in_per_group, k0, k1 = op.weight.shape
                left = torch.randn(count * kh * kw, c_out // op.groups, dtype=graph.dtype)
                right = torch.randn(c_out // op.groups, c_in_per_group * op.groups * k0 * k1, dtype=graph.dtype)
                row["matmul_ms"] = 1e3 * _best_seconds(lambda left=left, right=right: left @ right, repeats)
                dense = A.to_dense() if isinstance(A, Patches) else A
                row["dense_ms"] = 1e3 * _best_seconds(lambda op=op, A=dense, x=inputs: op.backward(A, x), repeats)
            results.append(row)
    return results


def _key(row: dict) -> tuple:
    return row["network"], row["start"], row["layer"], row["window"]


def measure_baseline(baseline: Path, paths: list[Path], rows: int, repeats: int) -> dict[tuple, float]:
    """``conv_ms`` of every step with the package of the checkout ``baseline`` (run in a subprocess)."""
    env = {**os.environ, "PYTHONPATH": str(baseline)}
    command = [sys.executable, __file__, "--rows", str(rows), "--repeats", str(repeats), "--worker"]
    output = subprocess.run(command + [str(p) for p in paths], env=env, capture_output=True, text=True)
    if output.returncode != 0:
        raise RuntimeError(f"the baseline's run failed:\n{output.stderr}")
    return {_key(row): row["conv_ms"] for row in json.loads(output.stdout)}


def format_table(rows: list[dict]) -> str:
    baseline = all("old_ms" in row for row in rows)
    head = f"{'network':<27} {'start':>5} {'layer':>5} {'window':>7} {'rows':>5} {'MFLOP':>8}"
    head += f" {'old ms':>8}" if baseline else ""
    head += f" {'new ms':>8} {'matmul':>8} {'dense ms':>8}"
    head += f" {'old/mm':>7}" if baseline else ""
    head += f" {'new/mm':>7} {'p/dense':>7}"
    head += f" {'old/new':>7}" if baseline else ""
    lines = [head]

    def line(net, start, layer, window, count, flops, old, new, matmul, dense) -> str:
        text = f"{net:<27} {start:>5} {layer:>5} {window:>7} {count:>5} {flops / 1e6:>8.2f}"
        text += f" {old:>8.3f}" if baseline else ""
        text += f" {new:>8.3f} {matmul:>8.3f} {dense:>8.3f}"
        text += f" {old / matmul:>7.2f}" if baseline else ""
        text += f" {new / matmul:>7.2f} {new / dense:>7.2f}"
        text += f" {old / new:>7.2f}" if baseline else ""
        return text

    for network in dict.fromkeys(row["network"] for row in rows):
        mine = [row for row in rows if row["network"] == network]
        for r in mine:
            lines.append(
                line(
                    network[:27], r["start"][:5], r["layer"][:5], r["window"], r["rows"], r["flops"],
                    r.get("old_ms"), r["conv_ms"], r["matmul_ms"], r["dense_ms"],
                )
            )  # fmt: skip
        totals = [sum(r[k] for r in mine) if all(k in r for r in mine) else None for k in
                  ("flops", "old_ms", "conv_ms", "matmul_ms", "dense_ms")]  # fmt: skip
        lines.append(line(network[:27], "total", "", "", "", *totals))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench convpass", description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, help="folder holding the VNN-COMP benchmark folders")
    parser.add_argument("--networks", nargs="+", default=list(DEFAULT_NETWORKS), help="benchmark folder names")
    parser.add_argument("--rows", type=int, default=512, help="coefficient rows per step (±e_i of rows/2 neurons)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per step; the table keeps the best")
    parser.add_argument("--baseline", type=Path, help="a checkout whose code is timed too (old ms, old/new)")
    parser.add_argument("--worker", nargs="+", type=Path, help=argparse.SUPPRESS)  # the baseline's subprocess
    args = parser.parse_args(argv)
    if args.rows < 2:
        parser.error(f"--rows must be at least 2, got {args.rows}")
    if args.worker:
        results = [r for p in args.worker for r in measure_network(p, args.rows, args.repeats, reference=False)]
        print(json.dumps(results))
        return
    if args.root is None:
        parser.error("--root is required")
    paths = []
    for network in args.networks:
        folder = args.root / network / "onnx"
        if not folder.is_dir():
            parser.error(f"--networks {network}: no folder {folder}")
        paths.extend(sorted(folder.glob("*.onnx*")))
    results = [row for path in paths for row in measure_network(path, args.rows, args.repeats)]
    if args.baseline is not None:
        old = measure_baseline(args.baseline.resolve(), paths, args.rows, args.repeats)
        for row in results:
            row["old_ms"] = old[_key(row)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(format_table(results))


if __name__ == "__main__":  # the baseline's worker runs this file directly
    main()
