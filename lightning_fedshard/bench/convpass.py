"""Time of one backward CROWN step through each convolution, against a dense matmul of the same FLOPs.

    python -m lightning_fedshard.bench convpass --root ../shared/vnncomp [--networks cifar_biasfield_2022 ...]
        [--rows 512] [--repeats 5]

(``fedshard bench convpass ...`` is the same.) For every ``Conv2d`` node of every ``.onnx``/``.onnx.gz`` under
``ROOT/NETWORK/onnx``, the step is the one the verifier takes when it bounds that node's neurons with patches: the
rows ``±e_i`` of ``--rows / 2`` neurons (as :meth:`Patches.identity` builds them) sent back through the layer by
:meth:`Conv2d.backward`. Its exact FLOP count is ``2 · rows · C_out/groups · C_in · kH · kW`` (each row's
``C_out`` coefficients times the layer's kernel); the reference is the matmul ``[rows, C_out/groups] @
[C_out/groups, C_in · kH · kW]``, which does the same multiply-adds as one dense GEMM, timed in the same run. A ratio
near 1 means the patches step runs at linear-layer speed; the table gives the best of ``--repeats`` timings.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_fedshard.verify import load_onnx
from lightning_fedshard.verify.ops import Interval
from lightning_fedshard.verify.ops.conv import Conv2d
from lightning_fedshard.verify.ops.patches import Patches

DEFAULT_NETWORKS = ("cifar_biasfield_2022", "verivital_2021")


def conv_step_flops(op: Conv2d, rows: int) -> int:
    """Multiply-adds × 2 of one backward step of ``rows`` one-neuron rows through ``op``."""
    c_out, c_in_per_group, kh, kw = op.weight.shape
    return 2 * rows * (c_out // op.groups) * c_in_per_group * op.groups * kh * kw


def _best_seconds(step: Callable[[], object], repeats: int) -> float:
    step()  # warm-up: allocator and kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def measure_network(path: Path, rows: int, repeats: int) -> list[dict]:
    """One table row per convolution of the network at ``path``."""
    graph = load_onnx(path)
    results = []
    for node in graph.nodes:
        if not isinstance(node.op, Conv2d):
            continue
        op, shape = node.op, node.shape
        neurons = min(rows // 2, int(torch.Size(shape).numel()))
        index = torch.linspace(0, torch.Size(shape).numel() - 1, neurons).long()
        identity = Patches.identity(index, batch=1, shape=shape, dtype=graph.dtype)
        # The step charges the layer's rounding on its input's magnitude (a unit box here; computed once per pass)
        ones = torch.ones(1, *graph.by_name[node.inputs[0]].shape, dtype=graph.dtype)
        inputs = [Interval(-ones, ones)]
        conv_seconds = _best_seconds(
            lambda op=op, identity=identity, inputs=inputs: op.backward(identity, inputs), repeats
        )
        c_out, c_in_per_group, kh, kw = op.weight.shape
        left = torch.randn(2 * neurons, c_out // op.groups, dtype=graph.dtype)
        right = torch.randn(c_out // op.groups, c_in_per_group * op.groups * kh * kw, dtype=graph.dtype)
        matmul_seconds = _best_seconds(lambda left=left, right=right: left @ right, repeats)
        results.append(
            {
                "network": path.name,
                "layer": node.name,
                "shape": shape,
                "rows": 2 * neurons,
                "flops": conv_step_flops(op, 2 * neurons),
                "conv_ms": conv_seconds * 1e3,
                "matmul_ms": matmul_seconds * 1e3,
            }
        )
    return results


def format_table(rows: list[dict]) -> str:
    lines = [f"{'network':<28} {'layer':<16} {'rows':>5} {'MFLOP':>9} {'conv ms':>9} {'matmul ms':>9} {'ratio':>7}"]
    for network in dict.fromkeys(row["network"] for row in rows):
        mine = [row for row in rows if row["network"] == network]
        for row in mine:
            lines.append(
                f"{network:<28} {row['layer'][:16]:<16} {row['rows']:>5} {row['flops'] / 1e6:>9.2f} "
                f"{row['conv_ms']:>9.3f} {row['matmul_ms']:>9.3f} {row['conv_ms'] / row['matmul_ms']:>7.2f}"
            )
        conv, matmul = sum(r["conv_ms"] for r in mine), sum(r["matmul_ms"] for r in mine)
        flops = sum(r["flops"] for r in mine)
        lines.append(
            f"{network:<28} {'total':<16} {'':>5} {flops / 1e6:>9.2f} {conv:>9.3f} {matmul:>9.3f} {conv / matmul:>7.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench convpass", description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="folder holding the VNN-COMP benchmark folders")
    parser.add_argument("--networks", nargs="+", default=list(DEFAULT_NETWORKS), help="benchmark folder names")
    parser.add_argument("--rows", type=int, default=512, help="coefficient rows per step (±e_i of rows/2 neurons)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per step; the table keeps the best")
    args = parser.parse_args(argv)
    if args.rows < 2:
        parser.error(f"--rows must be at least 2, got {args.rows}")
    results = []
    for network in args.networks:
        folder = args.root / network / "onnx"
        if not folder.is_dir():
            parser.error(f"--networks {network}: no folder {folder}")
        for path in sorted(folder.glob("*.onnx*")):
            results.extend(measure_network(path, args.rows, args.repeats))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(format_table(results))
