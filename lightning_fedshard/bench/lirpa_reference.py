"""auto_LiRPA's own CROWN and α-CROWN on the verify-memory networks and properties, measured with the same meter,
for ``fedshard bench verify-memory --auto-lirpa``: the single-process figures the sharded ones are read against.

auto_LiRPA 0.7.1 is not on the package index and not a dependency; for a benchmark run, install it from its
public repository (commit a050a3d) beside this package::

    pip install --no-deps --target /tmp/lirpa appdirs pyyaml tqdm graphviz   # packaging: the venv's own
    pip install --no-deps --no-build-isolation --target /tmp/lirpa ./auto_LiRPA
    PYTHONPATH=/tmp/lirpa fedshard bench verify-memory --auto-lirpa

Both libraries are measured by :class:`~lightning_fedshard.verify.memory.PeakMemoryMeter` (live tensor storage
made by aten ops, plus the weights as resident bytes) around the bound computation alone: auto_LiRPA's graph
tracing at :class:`BoundedModule` construction comes before it, as our ONNX loading does.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from lightning_fedshard.verify import BoundGraph, PeakMemoryMeter, Property
from lightning_fedshard.verify.memory import tensor_bytes
from lightning_fedshard.verify.objective import OutputSpec
from lightning_fedshard.verify.ops import Linear, ReLU, Reshape

__all__ = ["as_sequential", "auto_lirpa_bounds", "auto_lirpa_peaks"]


def as_sequential(graph: BoundGraph) -> nn.Sequential:
    """The ReLU MLP ``graph`` as ``nn.Linear``/``nn.ReLU`` layers holding the same weights (flattening reshapes
    dropped: the model takes a ``[1, inputs]`` batch); any other operator is a ``ValueError``."""
    layers: list[nn.Module] = []
    for node in graph.nodes[1:]:
        op = node.op
        if isinstance(op, Linear):
            out_features, in_features = op.weight.shape
            layer = nn.Linear(in_features, out_features, bias=op.bias is not None)
            with torch.no_grad():
                layer.weight.copy_(op.weight)
                if op.bias is not None:
                    layer.bias.copy_(op.bias)
            layers.append(layer)
        elif isinstance(op, ReLU):
            layers.append(nn.ReLU())
        elif not (isinstance(op, Reshape) and len(node.shape) == 1):
            raise ValueError(f"node {node.name!r} ({type(op).__name__}): only dense ReLU MLPs are compared")
    return nn.Sequential(*layers)


def auto_lirpa_peaks(graph: BoundGraph, prop: Property, alpha_iterations: int) -> dict[str, float | list[float]]:
    """auto_LiRPA's CROWN (no autograd) and α-CROWN (``alpha_iterations`` steps, lr 0.1, no early stop; once with
    its default of fixed intermediate bounds, once optimising them as ours does) on the first case of ``prop``:
    peak bytes and seconds of each, and CROWN's margins (lower bounds of ``M y − b``, to check that both bound the
    same thing)."""
    from auto_LiRPA import BoundedModule, BoundedTensor, PerturbationLpNorm

    case = prop.cases[0]
    model = as_sequential(graph).eval()
    lower = torch.as_tensor(case.box.lower, dtype=torch.float32).view(1, -1)
    upper = torch.as_tensor(case.box.upper, dtype=torch.float32).view(1, -1)
    spec = OutputSpec.from_case(case, graph.output.shape, torch.float32)
    C = spec.matrix.unsqueeze(0)  # [1, S, outputs]: lower bounds of M y
    weights = tensor_bytes(model.parameters())
    out: dict[str, float | list[float]] = {"baseline": weights}
    runs = (("crown", "CROWN", True), ("alpha_fixed", "alpha-CROWN", True), ("alpha", "alpha-CROWN", False))
    for key, method, fixed in runs:
        options = {"iteration": alpha_iterations, "lr_alpha": 0.1, "early_stop_patience": 10**6}
        options["fix_interm_bounds"] = fixed
        bounded = BoundedModule(model, torch.zeros_like(lower), {"optimize_bound_args": options}, device="cpu")
        x = BoundedTensor((lower + upper) / 2, PerturbationLpNorm(norm=float("inf"), x_L=lower, x_U=upper))
        start = time.monotonic()
        with PeakMemoryMeter("cpu", weights) as meter, torch.set_grad_enabled(method != "CROWN"):
            bound, _ = bounded.compute_bounds(x=(x,), C=C, method=method, bound_upper=False)
        out[f"{key}_peak"], out[f"{key}_time"] = meter.peak_bytes, time.monotonic() - start
        if key == "crown":
            out["crown_margins"] = (bound[0] - spec.rhs).tolist()
    return out


def auto_lirpa_bounds(
    model: nn.Module, lower: torch.Tensor, upper: torch.Tensor, alpha_iterations: int
) -> dict[str, tuple[list[float], list[float]] | str]:
    """auto_LiRPA's IBP, CROWN and α-CROWN (``alpha_iterations`` steps, lr 0.1, no early stop, each side optimised
    on its own) bounds ``(lower, upper)`` of ``model``'s outputs over the box ``[lower, upper]`` (``[1, inputs]``,
    for ``fedshard bench operators``); a method auto_LiRPA cannot run on the model maps to its error message."""
    from auto_LiRPA import BoundedModule, BoundedTensor, PerturbationLpNorm

    methods = {"ibp": "IBP", "crown": "CROWN", "alpha-crown": "CROWN-Optimized"}
    options = {"optimize_bound_args": {"iteration": alpha_iterations, "lr_alpha": 0.1, "early_stop_patience": 10**6}}
    try:
        bounded = BoundedModule(model, torch.zeros_like(lower), options, device="cpu")
    except Exception as error:  # noqa: BLE001 (an operator it has no bound class for, among others)
        return dict.fromkeys(methods, f"{type(error).__name__}: {error}")
    x = BoundedTensor((lower + upper) / 2, PerturbationLpNorm(norm=float("inf"), x_L=lower, x_U=upper))
    out: dict[str, tuple[list[float], list[float]] | str] = {}
    for key, method in methods.items():
        try:
            with torch.set_grad_enabled(method == "CROWN-Optimized"):
                low, high = bounded.compute_bounds(x=(x,), method=method)
            out[key] = (low[0].tolist(), high[0].tolist())
        except Exception as error:  # noqa: BLE001 (assertions and many other types for bounds it cannot compute)
            out[key] = f"{type(error).__name__}: {error}"
    return out
