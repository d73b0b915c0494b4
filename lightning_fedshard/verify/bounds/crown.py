"""CROWN: linear bounds carried backwards through the graph, concretised over the input box.

One pass bounds ``Σ C·v`` from below for a node ``v`` and spec rows ``C [S, B, *v.shape]``; upper bounds are
lower bounds of ``-C``. Intermediate bounds — of every node whose interval a relaxation reads (ReLU inputs, the
inputs of every other non-linear op) — come from the same pass started at that node, restricted to the neurons
whose bounds matter to those relaxations (for ReLU the unstable ones), in topological order so that every pass
only needs bounds that are already known. Passes started at a convolutional node carry their coefficients as
:class:`~lightning_fedshard.verify.ops.Patches` (local windows) for as long as the ops allow ("patches mode"); the
dense "matrix" mode gives the same bounds with far more memory.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_fedshard.verify.bounds.forward import ForwardPass
from lightning_fedshard.verify.budget import check_deadline, check_deadline_between_steps, run_in_chunks
from lightning_fedshard.verify.floats import round_down, unit_roundoff
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.ops import Conv2d, Interval, Patches, ReLU, contract, contract_abs, contract_error, flat
from lightning_fedshard.verify.shard.rows import RowPartition

__all__ = [
    "Backward",
    "backward_bound",
    "backward_bytes_per_row",
    "intermediate_bounds",
    "open_neurons",
    "selection_rows",
    "spec_lower",
    "unstable_count",
]


@dataclass
class Backward:
    """What one backward pass produced.

    ``lower [S, B]`` bounds ``Σ C·v`` from below; ``input_A [S, B, *input shape]`` are its coefficients on the
    input (``None`` if ``v`` does not depend on it), from which the minimising corner of the box follows;
    ``kept`` holds the coefficients that arrived at the nodes named in ``keep`` (for branching heuristics). Both
    are :class:`Patches` where a patches-mode pass got there with them.
    """

    lower: Tensor
    input_A: Tensor | Patches | None
    kept: dict[str, Tensor | Patches] = field(default_factory=dict)

    def minimiser(self, box: Interval) -> Tensor:
        """The box corner ``[S, B, *input shape]`` that minimises the linear bound of each row."""
        if self.input_A is None:  # any point minimises a constant bound: the centre, once per row and box
            return box.center.expand(*self.lower.shape, *box.center.shape[1:])
        A = self.input_A.to_dense() if isinstance(self.input_A, Patches) else self.input_A
        return torch.where(A >= 0, box.lower, box.upper)


def backward_bound(
    graph: BoundGraph,
    start: str,
    C: Tensor | Patches,
    box: Interval,
    bounds: Mapping[str, Interval],
    alphas: Mapping[str, Tensor] | None = None,
    betas: Mapping[str, tuple[Tensor, Tensor | None]] | None = None,
    keep: Collection[str] = (),
) -> Backward:
    """Lower bound of ``Σ C·start`` over ``box``; ``C [S, B, *start shape]`` dense, or :class:`Patches`.

    ``bounds`` must hold the intervals of every node a relaxation the pass crosses reads (``graph.bounded``); other
    ops that need their inputs' intervals (tensor-parallel zones) get them by interval propagation from the nearest
    known bounds. ``alphas`` maps non-linear node names to their α ``[S, B, *alpha shape]`` (else CROWN's
    choice); ``betas`` maps split nodes to β-CROWN's terms ``(β·s, p)`` for the split assumptions
    ``s·(z − p) ≥ 0`` (``s = +1`` above the split point ``p``, ``-1`` below, 0 unsplit; ``p = None``: 0):
    ``β·s`` is subtracted from the coefficients arriving there and ``Σ β·s·p`` added to the bound (dense passes
    only). Patches reaching an op without ``accepts_patches`` (Reshape, Linear) are made dense there. A one-rank
    pass stops at the run's deadline between operator steps
    (:func:`~lightning_fedshard.verify.budget.check_deadline_between_steps`).
    """
    known = {graph.input.name: box, **bounds}

    def interval(name: str) -> Interval:
        if name not in known:
            node = graph.by_name[name]
            known[name] = node.op.ibp(*(interval(source) for source in node.inputs))
        return known[name]

    pending = {start: C}
    bias: Tensor | float = 0.0  # float64: the constants of the steps, their rounding charged (see ops.base)
    kept: dict[str, Tensor] = {}
    input_A = None
    for node in reversed(graph.ancestors(start)):
        A = pending.pop(node.name, None)
        if A is None:
            continue
        check_deadline_between_steps()
        unit = unit_roundoff(A.dtype if isinstance(A, Tensor) else A.values.dtype)
        if betas is not None and node.name in betas:
            signed, point = betas[node.name]
            A = A - signed  # rounded: relative u of the result, on values up to |z|
            bias = bias - contract_abs(A, 2 * unit * interval(node.name).magnitude)
            if point is not None:
                summed = contract_error(point[0].numel(), point.dtype)
                bias = bias + contract(signed, point) - contract_abs(signed, summed * point.abs())
        if node.name in keep:
            kept[node.name] = A
        if node.op is None:
            input_A = A
            continue
        if isinstance(A, Patches) and not node.op.accepts_patches:
            A = A.to_dense()
            check_deadline_between_steps()  # densifying a large batch's rows is a step of its own
        needs_bounds = node.op.needs_input_bounds
        inputs = [interval(name) for name in node.inputs] if needs_bounds else [None] * len(node.inputs)
        alpha = alphas.get(node.name) if alphas is not None else None
        A_inputs, term = node.op.backward(A, inputs, alpha)
        if term is not None:
            bias = bias + term
        for name, A_in in zip(node.inputs, A_inputs, strict=True):
            if A_in is None:
                continue
            if name in pending:  # a node read by several consumers: their coefficients' sum rounds
                # Patches + dense (branches that met a dense-only op on one side) is dense.
                A_in = pending[name] + A_in
                bias = bias - contract_abs(A_in, 2 * unit * interval(name).magnitude)
            pending[name] = A_in
    rows = C.values if isinstance(C, Patches) else C
    lower = torch.zeros(rows.shape[:2], dtype=torch.float64, device=rows.device) + bias
    if input_A is not None:
        # The linear bound's minimum over the box, Σ A·mid − |A|·rad, with a radius that covers the box around the
        # rounded midpoint; both sums in float64, their products' rounding (half an ulp each) charged.
        mid = box.center
        rad = box.radius_around(mid)
        products = contract_abs(input_A, contract_error(mid[0].numel(), mid.dtype) * (mid.abs() + rad))
        lower = lower + contract(input_A, mid) - contract(input_A.abs(), rad) - products
    lower = round_down(lower, rows.dtype)
    return Backward(lower, input_A, kept)


def spec_lower(
    graph: BoundGraph,
    C: Tensor,
    box: Interval,
    bounds: Mapping[str, Interval],
    alphas: Mapping[str, Tensor] | None = None,
    partition: RowPartition | None = None,
) -> Tensor:
    """Lower bounds ``[S, B]`` of the output spec rows ``C [S, B, *output shape]``; with a ``partition`` this rank
    bounds only its chunk of the rows (``alphas`` are that chunk's) and the ranks exchange the results."""

    def bound(part: slice) -> Tensor:
        rows = C[part]
        if partition is None:
            return backward_bound(graph, graph.output.name, rows, box, bounds, alphas).lower
        mine = partition.chunk(rows)
        local = backward_bound(graph, graph.output.name, mine, box, bounds, alphas).lower
        return partition.gather(local, rows.shape[0])

    if alphas is not None:  # α's rows are optimised together (bounds/alpha.py sizes them)
        return bound(slice(None))
    estimate = backward_bytes_per_row(graph, graph.output.name, C.shape[1], C.dtype)
    return torch.cat(run_in_chunks("crown:output", C.shape[0], estimate, bound))


def backward_bytes_per_row(graph: BoundGraph, start: str, batch: int, dtype: torch.dtype) -> int:
    """An upper estimate of the bytes one row of a backward pass from ``start`` holds at its peak: its
    coefficients on every node it crosses (a dense pass's pending coefficients never exceed them) and four
    temporaries the size of the largest (an operator's backward step, the rounding charge's ``|A|``)."""
    sizes = [node.size for node in graph.ancestors(start)]
    return batch * torch.empty((), dtype=dtype).element_size() * (sum(sizes) + 4 * max(sizes))


def unstable_count(graph: BoundGraph, bounds: Mapping[str, Interval]) -> Tensor:
    """Unstable ReLUs per batch element ``[B]`` under the pre-activation ``bounds [B, *shape]``."""
    return sum(flat(ReLU.unstable(bounds[pre]), 1).sum(1) for pre in graph.pre_activation.values())


def open_neurons(graph: BoundGraph, bounds: Mapping[str, Interval]) -> Tensor:
    """Neurons branch-and-bound could still split, per batch element ``[B]`` (for ReLU: the unstable ones)."""
    counts = [flat(graph.split_mask(name, bounds), 1).sum(1) for name in graph.split_nodes]
    return sum(counts) if counts else torch.zeros(bounds[graph.input.name].lower.shape[0], dtype=torch.long)


def selection_rows(index: Tensor, batch: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Spec rows ``[2U, B, *shape]`` picking ``+v_i`` then ``-v_i`` for each flat index ``i``: one pass then
    gives lower bounds (first U rows) and negated upper bounds (last U rows)."""
    U, size = index.numel(), int(torch.Size(shape).numel())
    rows = torch.zeros(2 * U, size, dtype=dtype, device=index.device)
    positions = torch.arange(U, device=index.device)
    rows[positions, index] = 1
    rows[positions + U, index] = -1
    return rows.unsqueeze(1).expand(2 * U, batch, size).reshape(2 * U, batch, *shape)


def _refine(current: Interval, index: Tensor, lower: Tensor, upper: Tensor, intersect: bool) -> Interval:
    """``current`` with the neurons at flat ``index`` replaced by (or intersected with) ``[lower, upper]``
    (each ``[B, U]``)."""
    shape = current.lower.shape
    lo, hi = flat(current.lower, 1).clone(), flat(current.upper, 1).clone()
    lo[:, index] = torch.maximum(lo[:, index], lower) if intersect else lower
    hi[:, index] = torch.minimum(hi[:, index], upper) if intersect else upper
    return Interval(lo.view(shape), hi.view(shape))


def _behind_conv(graph: BoundGraph, name: str) -> bool:
    """Whether node ``name`` is ``(C, H, W)``-shaped with a convolution among its ancestors: the nodes whose rows
    depend on small windows of the nodes before them."""
    shape = graph.by_name[name].shape
    return len(shape) == 3 and any(isinstance(node.op, Conv2d) for node in graph.ancestors(name))


def intermediate_bounds(
    graph: BoundGraph,
    box: Interval,
    alphas: Mapping[str, Mapping[str, Tensor]] | None = None,
    reference: Mapping[str, Interval] | None = None,
    rows: Mapping[str, Tensor] | None = None,
    crown: bool = True,
    intersect_ibp: bool = True,
    used_rows: dict[str, Tensor] | None = None,
    conv_mode: str = "patches",
    partition: RowPartition | None = None,
    forward: bool = False,
) -> dict[str, Interval]:
    """Bounds of every node up to the output: interval propagation, with each bounded node (``graph.bounded``)
    tightened by CROWN on the neurons its relaxations need (``crown=False``: IBP alone).

    ``alphas[start][node]`` are α-CROWN's parameters for the pass started at bounded node ``start``;
    ``reference`` bounds (known valid, e.g. from a previous pass) are intersected in; ``rows[start]`` fixes the
    neurons refined by CROWN (α-CROWN keeps them fixed so its slope tensors keep their shape), else they are
    those the relaxations need (``graph.refine_mask``: for ReLU the unstable ones). With ``intersect_ibp=False`` CROWN's bounds replace the interval ones on those neurons,
    as auto_LiRPA does (its reference numbers are reproduced that way). Intersecting tightens the refined layer
    itself; deeper layers are usually tighter too, not always (tighter bounds can flip adaptive slopes).
    ``used_rows``, when given, receives the neurons refined at each pre-activation node.

    ``conv_mode="patches"`` starts the passes of convolutional bounded nodes ``(C, H, W)`` (those behind a
    convolution) from :class:`Patches` rows, unless α slopes are given for them (α is per row and dense anyway);
    ``"matrix"`` uses dense rows everywhere. Both give the same bounds up to rounding.

    With a ``partition`` each pass bounds only this rank's chunk of the refined neurons (``alphas`` hold that
    chunk's rows) and the ranks exchange the results: every rank ends with all the bounds.

    ``forward=True`` also intersects every node with its forward-mode linear bounds
    (:class:`~lightning_fedshard.verify.bounds.forward.ForwardPass`, built from the bounds refined so far) before
    choosing the unstable neurons: cheap for few inputs, and fewer neurons left for CROWN to refine.

    Before each CROWN pass the run's deadline is checked (:func:`~lightning_fedshard.verify.budget.check_deadline`),
    and a pass that does not fit its memory budget runs in chunks (:func:`~lightning_fedshard.verify.budget.run_in_chunks`).
    """
    if conv_mode not in ("patches", "matrix"):
        raise ValueError(f"conv_mode must be 'patches' or 'matrix', got {conv_mode!r}")
    bounded = set(graph.bounded)
    bounds: dict[str, Interval] = {graph.input.name: box}
    linear = ForwardPass(graph, box) if forward else None
    if linear is not None:
        linear.tighten(graph.input, box, bounds)
    batch, dtype = box.lower.shape[0], box.lower.dtype
    for node in graph.nodes[1:]:
        interval = node.op.ibp(*(bounds[name] for name in node.inputs))
        if linear is not None:
            interval = linear.tighten(node, interval, bounds)
        if node.name in bounded and reference is not None and node.name in reference:
            ref = reference[node.name]
            interval = Interval(torch.maximum(interval.lower, ref.lower), torch.minimum(interval.upper, ref.upper))
        if node.name in graph.crown_targets and crown and not graph.ibp_is_exact(node.name):
            if rows is not None and node.name in rows:
                index = rows[node.name]
            elif graph.crown_targets[node.name]:  # a source of larger copies: all of it
                index = flat((interval.upper > interval.lower), 1).any(0).nonzero().flatten()
            else:
                mask = graph.refine_mask(node.name, {**bounds, node.name: interval})
                index = flat(mask, 1).any(0).nonzero().flatten()
            if used_rows is not None:
                used_rows[node.name] = index
            if index.numel():
                check_deadline()
                start_alphas = alphas.get(node.name) if alphas is not None else None
                patches = conv_mode == "patches" and start_alphas is None and _behind_conv(graph, node.name)

                def bound(part: slice, node=node, alphas=start_alphas, patches=patches, index=index) -> Tensor:
                    """``[U, 2, B]``: lower and upper bounds of the neurons ``index[part]``."""
                    chunk = index[part]
                    mine = chunk if partition is None else chunk[partition.span(chunk.numel())]
                    rows = Patches.identity if patches else selection_rows
                    C = rows(mine, batch, node.shape, dtype)
                    lower = backward_bound(graph, node.name, C, box, bounds, alphas).lower
                    U = mine.numel()
                    both = torch.stack([lower[:U], -lower[U:]], 1)
                    return both if partition is None else partition.gather(both, chunk.numel())

                if start_alphas is None:  # α passes are sized by α-CROWN as a whole (bounds/alpha.py)
                    estimate = 2 * backward_bytes_per_row(graph, node.name, batch, dtype)
                    both = torch.cat(run_in_chunks(f"crown:{node.name}", index.numel(), estimate, bound))
                else:
                    both = bound(slice(None))
                interval = _refine(interval, index, both[:, 0].T, both[:, 1].T, intersect_ibp)
        bounds[node.name] = interval
        if node is graph.output:
            break
    return bounds
