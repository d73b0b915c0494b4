"""Proofs re-checked in float64: float32 rounding must not be able to turn a spec row's bound positive.

A float32 pass sums products of weights, slopes and bounds with rounding errors proportional to the magnitudes
it sums, and nothing widens its result: on a network with large weights the error exceeds a small true margin,
and a row the network violates (in the real arithmetic the verifier reasons in, on the float32 weights) can come
out proven. So wherever a float32 bound claims a row (``margin > 0``), the pass that gave it is repeated on a
float64 copy of the graph — the same intermediate bounds, slopes ``α`` and multipliers ``β`` (all float32 values,
exact in float64) — against the property's float64 rows (:attr:`OutputSpec.exact`); a claimed margin that
float64 refutes is replaced by the float64 one rounded down: only a margin that float64 confirms proves anything.
Rows not claimed are left alone (they prove nothing either way), so the cost is one float64 output pass per
proven domain.

What this leaves: float64's own rounding (2^-53 relative, 2^29 times below float32's), and the float32 rounding
inside the intermediate bounds the final pass reads. Sharded graphs (weights split over ranks, Megatron zones)
exist whole on no rank and are not re-checked.

Example::

    margins = confirm(graph, spec, box, bounds, lower.T - spec.rhs, alphas)   # [N, S]
    proven = spec.value(margins) > 0
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Mapping

import torch
from torch import Tensor

from lightning_fedshard.verify.bounds.crown import Backward, backward_bound
from lightning_fedshard.verify.floats import round_down
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.objective import OutputSpec
from lightning_fedshard.verify.ops import Interval

__all__ = ["confirm", "confirm_interval", "float64_graph", "interval_margins", "margins", "output_pass"]

_COPIES: weakref.WeakKeyDictionary[BoundGraph, BoundGraph | None] = weakref.WeakKeyDictionary()


def _sharded(graph: BoundGraph) -> bool:
    from lightning_fedshard.verify.shard.zones import MegatronZone

    return any(hasattr(node.op, "_fsdp_gatherer") or isinstance(node.op, MegatronZone) for node in graph.nodes[1:])


def float64_graph(graph: BoundGraph) -> BoundGraph | None:
    """``graph`` with its constants in float64, copied once per graph (on first use: only a run that claims a
    proof pays for it); ``graph`` itself if it computes in float64 already, ``None`` for a sharded graph."""
    if graph.dtype == torch.float64:
        return graph
    if graph not in _COPIES:
        _COPIES[graph] = None if _sharded(graph) else copy.deepcopy(graph).to(torch.float64)
    return _COPIES[graph]


def _replace_claims(margins: Tensor, claimed: Tensor, index: Tensor, exact: Tensor) -> Tensor:
    """``margins`` with the claimed rows of batch elements ``index`` that ``exact`` (float64) refutes replaced by
    it, rounded down to their dtype. Confirmed rows keep their value, so a run whose every claim holds gives the
    same margins as before, bit for bit (and as a sharded run, which is not re-checked)."""
    out = margins.clone()
    refuted = claimed[index] & ~(exact > 0)
    out[index] = torch.where(refuted, round_down(exact, margins.dtype), margins[index])
    return out


def _double_pass(
    double: BoundGraph,
    spec: OutputSpec,
    box: Interval,
    bounds: Mapping[str, Interval],
    alphas: Mapping[str, Tensor] | None = None,
    betas: Mapping[str, tuple[Tensor, Tensor | None]] | None = None,
    index: Tensor | None = None,
    deadline: float | None = None,
) -> Backward:
    """The backward pass over the property's float64 rows on the float64 graph, for the batch elements ``index``
    (all where ``None``) of ``box``/``bounds`` (batch ``N`` or 1), ``alphas [S, N, …]`` and β terms; it stops at
    the ``deadline`` between operator steps (:func:`backward_bound`)."""
    n = max(box.lower.shape[0], *(b.lower.shape[0] for b in bounds.values()))

    def take(t: Tensor, dim: int = 0) -> Tensor:
        return (t.index_select(dim, index) if index is not None and t.shape[dim] == n else t).double()

    batch = n if index is None else index.numel()
    rows = spec.exact[0].view(spec.num_rows, 1, *spec.output_shape).expand(-1, batch, *spec.output_shape)
    return backward_bound(
        double,
        double.output.name,
        rows,
        Interval(take(box.lower), take(box.upper)),
        {name: Interval(take(b.lower), take(b.upper)) for name, b in bounds.items()},
        None if alphas is None else {name: take(a, 1) for name, a in alphas.items()},
        None
        if betas is None
        else {name: (take(s, 1), None if p is None else take(p)) for name, (s, p) in betas.items()},
        deadline=deadline,
    )


def confirm(
    graph: BoundGraph,
    spec: OutputSpec,
    box: Interval,
    bounds: Mapping[str, Interval],
    margins: Tensor,
    alphas: Mapping[str, Tensor] | None = None,
    betas: Mapping[str, tuple[Tensor, Tensor | None]] | None = None,
) -> Tensor:
    """``margins [N, S]`` of the spec rows from the backward pass over ``box``, ``bounds`` (batch ``N`` or 1),
    ``alphas [S, N, …]`` and β terms ``(β·s [S, N, …], p [N, …])`` (as :func:`backward_bound` takes them), with
    every positive margin that the same pass in float64 refutes replaced by that one, rounded down (see the module
    docs)."""
    if margins.dim() != 2 or margins.shape[1] != spec.num_rows:
        raise ValueError(f"margins must be [N, {spec.num_rows}] (one column per spec row), got {list(margins.shape)}")
    claimed = margins > 0  # NaN claims nothing
    double = float64_graph(graph)
    if double is None or double is graph or not bool(claimed.any()):
        return margins
    index = claimed.any(1).nonzero().flatten()
    lower = _double_pass(double, spec, box, bounds, alphas, betas, index).lower
    return _replace_claims(margins, claimed, index, lower.T - spec.exact[1])


def output_pass(
    graph: BoundGraph,
    spec: OutputSpec,
    box: Interval,
    bounds: Mapping[str, Interval],
    deadline: float | None = None,
) -> Backward:
    """CROWN's pass over the spec rows of every box ``[B, …]`` run in float64 (in float32 where the graph is
    sharded), its lower bounds rounded down to the graph's dtype and its input coefficients float64. Input
    splitting takes its proofs (:func:`margins`) and its clipping planes from it, so a float32 plane can neither
    prove a box nor cut a counterexample away."""
    double = float64_graph(graph)
    if double is None:
        return backward_bound(graph, graph.output.name, spec.rows(box.lower.shape[0]), box, bounds, deadline=deadline)
    out = _double_pass(double, spec, box, bounds, deadline=deadline)
    out.lower = round_down(out.lower, graph.dtype)
    return out


def margins(spec: OutputSpec, lower: Tensor) -> Tensor:
    """The margins ``[B, S]`` of the spec rows' lower bounds ``lower [S, B]`` against the property's float64
    right-hand sides, rounded down to ``lower``'s dtype."""
    return round_down(lower.T.double() - spec.exact[1], lower.dtype)


def interval_margins(graph: BoundGraph, box: Interval, matrix: Tensor, rhs: Tensor) -> Tensor:
    """The spec rows' margins ``[B, S]`` from interval propagation over ``box [B, …]``."""
    out = graph.ibp(box)[graph.output.name]
    lower, upper = out.lower.flatten(1), out.upper.flatten(1)
    return lower @ matrix.clamp(min=0).T + upper @ matrix.clamp(max=0).T - rhs


def confirm_interval(graph: BoundGraph, spec: OutputSpec, box: Interval, margins: Tensor) -> Tensor:
    """``margins [B, S]`` from :func:`interval_margins`, every positive one that interval propagation in float64
    refutes replaced by that one, rounded down."""
    claimed = margins > 0
    double = float64_graph(graph)
    if double is None or double is graph or not bool(claimed.any()):
        return margins
    index = claimed.any(1).nonzero().flatten()
    exact = interval_margins(double, Interval(box.lower[index].double(), box.upper[index].double()), *spec.exact)
    return _replace_claims(margins, claimed, index, exact)
