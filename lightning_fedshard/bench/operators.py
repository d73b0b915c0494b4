"""Bounds of every non-linear operator, ours next to auto_LiRPA's, on one small graph per operator.

    python -m lightning_fedshard.bench operators [--alpha-iterations 20] [--samples 20000] [--out runs/operators]

(``fedshard bench operators ...`` is the same; ``--auto-lirpa`` adds auto_LiRPA's bounds, installed for the run
only as :mod:`lightning_fedshard.bench.lirpa_reference` says.) Each graph is ``x ∈ [-1, 1]⁴ → Linear(4, 8) → op →
Linear(8, 3)`` as a torch module (two linear branches for the products and quotients of two computed tensors, a
shifted input layer for the functions defined on positive numbers), exported to ONNX and loaded by
:func:`~lightning_fedshard.verify.load_onnx`; auto_LiRPA bounds the torch module itself. For each of IBP, CROWN and
α-CROWN the table gives the mean width ``upper − lower`` of the three outputs, ours over auto_LiRPA's (below 1:
ours is tighter), and each tool's soundness against ``--samples`` points of the box and its corners evaluated by
onnxruntime: the largest amount by which a sample leaves the bounds (0: none does).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lightning_fedshard.verify import CasePhases, load_onnx
from lightning_fedshard.verify.spec import Case, Disjunct, InputBox

INPUTS, HIDDEN, OUTPUTS = 4, 8, 3
METHODS = ("ibp", "crown", "alpha-crown")


class OperatorNet(nn.Module):
    """``Linear(4, 8) → op → Linear(8, 3)``; ``op`` takes one hidden tensor, or two (``binary``) from two input
    layers. ``positive`` shifts the input layer so that its outputs stay above 0.3 on the box."""

    def __init__(self, op: Callable[..., torch.Tensor], binary: bool = False, positive: bool = False) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.op, self.binary = op, binary
        self.first = nn.Linear(INPUTS, HIDDEN)
        self.second = nn.Linear(INPUTS, HIDDEN) if binary else None
        self.head = nn.Linear(HIDDEN, OUTPUTS)
        with torch.no_grad():
            for layer in (self.first, self.second, self.head):
                if layer is None:
                    continue
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) / layer.in_features**0.5)
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator) * 0.3)
            shifted = [self.second] if binary and positive else [self.first] if positive else []
            for layer in shifted:  # |W x| ≤ 0.25·4 = 1 on the box: the layer's outputs lie in [0.3, 2.7]
                layer.weight.mul_(0.25 / layer.weight.abs().max())
                layer.bias.copy_(
                    torch.full_like(layer.bias, 1.3) + torch.rand(layer.bias.shape, generator=generator) * 0.4
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.op(self.first(x), self.second(x)) if self.binary else self.op(self.first(x))
        return self.head(hidden)


def _matmul_of_two(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a.view(-1, 2, 4), b.view(-1, 4, 2)).reshape(-1, HIDDEN // 2).repeat(1, 2)


def _max_pool(a: torch.Tensor) -> torch.Tensor:
    """2 × 2 max pooling of the hidden layer as a 2-channel 2 × 2 map, each maximum used twice."""
    return nn.functional.max_pool2d(a.view(-1, 2, 2, 2), 2, 2).reshape(-1, 2).repeat(1, HIDDEN // 2)


#: name → (op, binary, positive)
OPERATORS: dict[str, tuple[Callable[..., torch.Tensor], bool, bool]] = {
    "Sigmoid": (torch.sigmoid, False, False),
    "Tanh": (torch.tanh, False, False),
    "Exp": (torch.exp, False, False),
    "Log": (torch.log, False, True),
    "Sqrt": (torch.sqrt, False, True),
    "Reciprocal": (torch.reciprocal, False, True),
    "Sin": (torch.sin, False, False),
    "Cos": (torch.cos, False, False),
    "Pow 2": (lambda a: torch.pow(a, 2), False, False),
    "Pow 3": (lambda a: torch.pow(a, 3), False, False),
    "Pow 0.5": (lambda a: torch.pow(a, 0.5), False, True),
    "Abs": (torch.abs, False, False),
    "LeakyRelu": (lambda a: nn.functional.leaky_relu(a, 0.1), False, False),
    "Sign": (torch.sign, False, False),
    "Clip": (lambda a: torch.clamp(a, -0.5, 0.5), False, False),
    "Floor": (torch.floor, False, False),
    "Softmax": (lambda a: torch.softmax(a, -1), False, False),
    "MaxPool": (_max_pool, False, False),
    "Mul of two": (torch.mul, True, False),
    "Div of two": (torch.div, True, True),
    "MatMul of two": (_matmul_of_two, True, False),
}


def build(name: str, folder: Path) -> tuple[OperatorNet, Path]:
    """The torch module of operator ``name`` and its ONNX export (TorchScript exporter, opset 13)."""
    op, binary, positive = OPERATORS[name]
    model = OperatorNet(op, binary, positive).eval()
    path = folder / f"{name.replace(' ', '_')}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice
        torch.onnx.export(model, torch.zeros(1, INPUTS), str(path), opset_version=13, dynamo=False)
    return model, path


def _case() -> Case:
    """The box ``[-1, 1]⁴`` with one disjunct of rows ``+y_i`` and ``−y_i``: their lower bounds are the outputs'
    lower bounds and minus their upper bounds."""
    matrix = np.vstack([np.eye(OUTPUTS), -np.eye(OUTPUTS)])
    return Case(InputBox(np.full(INPUTS, -1.0), np.ones(INPUTS)), [Disjunct(matrix, np.zeros(2 * OUTPUTS))])


def our_bounds(path: Path, alpha_iterations: int) -> dict[str, tuple[list[float], list[float]]]:
    """IBP, CROWN and α-CROWN bounds ``(lower, upper)`` of the outputs of the ONNX model at ``path``."""
    graph = load_onnx(path)
    phases = CasePhases(graph, _case())
    ibp = graph.ibp(phases.box)[graph.output.name]
    crown = phases.crown()
    alpha = phases.spec.margins(phases.alpha(alpha_iterations).lower)[0]
    return {"ibp": (ibp.lower[0].tolist(), ibp.upper[0].tolist()), "crown": _sides(crown), "alpha-crown": _sides(alpha)}


def _sides(rows: torch.Tensor) -> tuple[list[float], list[float]]:
    """Lower bounds of ``+y`` then ``−y`` → ``(lower, upper)`` of ``y``."""
    return rows[:OUTPUTS].tolist(), (-rows[OUTPUTS:]).tolist()


def sampled_outputs(path: Path, samples: int) -> np.ndarray:
    """onnxruntime's outputs ``[N, 3]`` at ``samples`` uniform points of the box and its 16 corners."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    rng = np.random.default_rng(0)
    corners = np.array(list(itertools.product((-1.0, 1.0), repeat=INPUTS)))
    points = np.vstack([rng.uniform(-1, 1, (samples, INPUTS)), corners]).astype(np.float32)
    return np.vstack([session.run(None, {name: p[None]})[0] for p in points]).astype(np.float64)


def _violation(bounds: tuple[list[float], list[float]], y: np.ndarray) -> float:
    lower, upper = np.array(bounds[0]), np.array(bounds[1])
    return float(max(0.0, (lower - y).max(), (y - upper).max()))


def _width(bounds: tuple[list[float], list[float]]) -> float:
    return float(np.mean(np.array(bounds[1]) - np.array(bounds[0])))


def run(folder: Path, alpha_iterations: int, samples: int, with_auto_lirpa: bool) -> list[dict]:
    """One row per operator: each tool's bounds and widths per method, the sampled range and the violations."""
    if with_auto_lirpa:
        from lightning_fedshard.bench.lirpa_reference import auto_lirpa_bounds
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in OPERATORS:
        model, path = build(name, folder)
        y = sampled_outputs(path, samples)
        row: dict = {"operator": name, "sampled_width": float(np.mean(y.max(0) - y.min(0)))}
        tools = {"ours": our_bounds(path, alpha_iterations)}
        if with_auto_lirpa:
            tools["auto_LiRPA"] = auto_lirpa_bounds(
                model, -torch.ones(1, INPUTS), torch.ones(1, INPUTS), alpha_iterations
            )
        for tool, bounds in tools.items():
            for method in METHODS:
                found = bounds.get(method)
                if isinstance(found, str):  # the tool could not bound it: the reason
                    row[f"{tool} {method}"] = found
                    continue
                row[f"{tool} {method}"] = {"width": _width(found), "violation": _violation(found, y), "bounds": found}
        rows.append(row)
    return rows


def _cell(row: dict, tool: str, method: str) -> str:
    found = row.get(f"{tool} {method}")
    if found is None:
        return "–"
    if isinstance(found, str):
        return "fails"
    mark = "" if found["violation"] <= 1e-5 * (1 + found["width"]) else f" (unsound by {found['violation']:.1e})"
    return f"{found['width']:.4g}{mark}"


def format_table(rows: list[dict], with_auto_lirpa: bool) -> str:
    """Markdown: mean output width per method, ours and auto_LiRPA's, and their ratio."""
    tools = ("ours", "auto_LiRPA") if with_auto_lirpa else ("ours",)
    header = ["operator", "sampled range"]
    for method in METHODS:
        header += [f"{method} {tool}" for tool in tools] + (["ours/theirs"] if with_auto_lirpa else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["operator"], f"{row['sampled_width']:.4g}"]
        for method in METHODS:
            cells += [_cell(row, tool, method) for tool in tools]
            if with_auto_lirpa:
                ours, theirs = row.get(f"ours {method}"), row.get(f"auto_LiRPA {method}")
                both = isinstance(ours, dict) and isinstance(theirs, dict) and theirs["width"] > 0
                cells.append(f"{ours['width'] / theirs['width']:.3f}" if both else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench operators", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/operators"))
    parser.add_argument("--alpha-iterations", type=int, default=20)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument(
        "--auto-lirpa", action="store_true", help="also auto_LiRPA's bounds (install it first: see lirpa_reference)"
    )
    args = parser.parse_args(argv)
    if args.auto_lirpa and importlib.util.find_spec("auto_LiRPA") is None:
        parser.error("--auto-lirpa: auto_LiRPA is not importable (see lightning_fedshard/bench/lirpa_reference.py)")
    torch.set_num_threads(1)
    rows = run(args.out, args.alpha_iterations, args.samples, args.auto_lirpa)
    print(format_table(rows, args.auto_lirpa))
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
