"""α-CROWN: CROWN with the relaxations' free parameters optimised by projected gradient ascent on the bound.

Every pass (one per refined bounded node, plus the output spec) gets its own parameters
``α[start][node] : [S_start, B, *alpha shape]`` (S_start = 2·refined neurons for an intermediate node, the spec
rows for the output) for every non-linear op it crosses that has any (ReLU: its lower slope; the other element-wise
functions: where their two slopes lie; products: the weights of their McCormick planes), initialised to CROWN's
choice. Each iteration recomputes all intermediate bounds with the current parameters, bounds the spec, and takes
an Adam step on ``-Σ lower bounds``; the parameters are projected back to ``[0, 1]`` (every value there is a valid
relaxation), and the best bound seen for every row (and every intermediate neuron) is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_fedshard.verify.bounds.adam import Adam
from lightning_fedshard.verify.bounds.crown import backward_bytes_per_row, intermediate_bounds, spec_lower
from lightning_fedshard.verify.budget import CHUNK_SHARE, current_budget, time_is_up
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.ops import Interval
from lightning_fedshard.verify.shard.lockstep import agree
from lightning_fedshard.verify.shard.rows import RowPartition

__all__ = ["ALPHA_ELEMENTS", "AlphaResult", "alpha_crown", "initial_alphas", "iteration_bytes"]

#: At most this many α values (each with two Adam moments and a gradient besides: 1 GiB in all in float32), and no
#: more than fit the run's memory budget (:class:`~lightning_fedshard.verify.budget.Budget`) with what autograd
#: keeps of the passes. Past it only the output pass is optimised and the intermediate passes keep CROWN's
#: relaxations (a graph whose intermediate passes cross large non-linear layers — ReLU lookup tables of 20,000
#: neurons, started from hundreds of rows each — would need gigabytes, and verivital's MaxPool net took 30 s
#: instead of 6 s with them); past it for the output pass alone, α-CROWN is CROWN.
ALPHA_ELEMENTS = 1 << 26
#: Copies of every α an optimisation holds: the value, its gradient, Adam's two moments, the best one kept.
_ALPHA_COPIES = 5


def iteration_bytes(graph: BoundGraph, start: str, rows: int, batch: int, dtype: torch.dtype) -> int:
    """An estimate of the bytes one optimised pass from ``start`` with ``rows`` rows holds while its gradient is
    taken: its α with their optimiser state, and the coefficients autograd keeps at every step it crosses."""
    alphas = _alpha_elements(graph, start, rows, batch) * torch.empty((), dtype=dtype).element_size()
    return _ALPHA_COPIES * alphas + rows * backward_bytes_per_row(graph, start, batch, dtype)


def _affordable(elements: int, nbytes: int) -> bool:
    """Whether α-CROWN may optimise ``elements`` α values whose iterations hold ``nbytes`` (the same answer on
    every rank of a sharded run)."""
    budget = current_budget()
    fits = elements <= ALPHA_ELEMENTS and (budget is None or nbytes <= budget.free() * CHUNK_SHARE)
    return not agree(not fits)


@dataclass
class AlphaResult:
    """Best bounds found: ``lower [S, B]`` of the spec, the bounded nodes' ``bounds`` (each at least as tight as
    CROWN's), the output pass's parameters ``alphas[node] [S, B, *alpha shape]`` that reached ``lower`` (to start
    branch-and-bound from) and the number of iterations run."""

    lower: Tensor
    bounds: dict[str, Interval]
    alphas: dict[str, Tensor]
    iterations: int

    def rows(self, index: Tensor) -> AlphaResult:
        """The result restricted to spec rows ``index`` (the intermediate bounds are shared by all rows)."""
        alphas = {name: alpha[index] for name, alpha in self.alphas.items()}
        return AlphaResult(self.lower[index], self.bounds, alphas, self.iterations)


def initial_alphas(graph: BoundGraph, start: str, rows: int, bounds: dict[str, Interval]) -> dict[str, Tensor]:
    """CROWN's choice as α ``[rows, B, *alpha shape]`` for every op with α that the pass from ``start`` crosses."""
    alphas = {}
    for node in graph.ancestors(start):
        if node.op is None or node.op.alpha_shape(node.shape) is None:
            continue
        alpha = node.op.initial_alpha([bounds[name] for name in node.inputs])
        alphas[node.name] = alpha.unsqueeze(0).repeat(rows, *([1] * alpha.dim()))
    return alphas


def _alpha_elements(graph: BoundGraph, start: str, rows: int, batch: int) -> int:
    """How many α values the pass from ``start`` with ``rows`` rows holds (before any is made)."""
    total = 0
    for node in graph.ancestors(start):
        shape = node.op.alpha_shape(node.shape) if node.op is not None else None
        if shape is not None:
            total += rows * batch * int(torch.Size(shape).numel())
    return total


def alpha_crown(
    graph: BoundGraph,
    box: Interval,
    C: Tensor,
    iterations: int = 40,
    lr: float = 0.1,
    lr_decay: float = 0.98,
    stop_above: Tensor | None = None,
    intersect_ibp: bool = True,
    partition: RowPartition | None = None,
    reference: dict[str, Interval] | None = None,
) -> AlphaResult:
    """Optimise the lower bound of ``Σ C·output`` (``C [S, B, *output shape]``) over ``box``.

    Stops early once every row's bound exceeds ``stop_above [S, B]`` (the property is proven), or at the run's
    deadline (:func:`~lightning_fedshard.verify.budget.time_is_up`). ``reference`` bounds of pre-activation nodes (known valid, e.g.
    refined by LP/MILP) are intersected into every intermediate bound kept. With a ``partition`` every pass bounds
    only this rank's chunk of its rows, so this rank holds only that chunk's slopes (and their optimiser state); the
    returned output slopes are gathered whole.
    """
    output = graph.output.name
    refined: dict[str, Tensor] = {}

    def local_rows(n: int) -> int:
        return n if partition is None else len(range(n)[partition.span(n)])

    with torch.no_grad():
        start_bounds = intermediate_bounds(
            graph,
            box,
            reference=reference,
            intersect_ibp=intersect_ibp,
            used_rows=refined,
            partition=partition,
        )
        crown_lower = spec_lower(graph, C, box, start_bounds, partition=partition)
    refined = {pre: index for pre, index in refined.items() if index.numel()}
    batch = box.lower.shape[0]
    rows = {pre: 2 * local_rows(index.numel()) for pre, index in refined.items()}
    rows[output] = local_rows(C.shape[0])
    elements = {start: _alpha_elements(graph, start, count, batch) for start, count in rows.items()}
    nbytes = {start: iteration_bytes(graph, start, count, batch, C.dtype) for start, count in rows.items()}
    # The output pass's α first; the intermediate passes' too if all of them fit besides.
    with_output = _affordable(elements[output], nbytes[output])
    intermediate = with_output and _affordable(sum(elements.values()), sum(nbytes.values()))
    alphas = {pre: initial_alphas(graph, pre, rows[pre], start_bounds) if intermediate else {} for pre in refined}
    alphas[output] = initial_alphas(graph, output, rows[output], start_bounds) if with_output else {}
    parameters = [alpha.requires_grad_() for per_start in alphas.values() for alpha in per_start.values()]

    best_lower = crown_lower.clone()
    best_bounds = {name: start_bounds[name] for name in graph.bounded if name in start_bounds}
    best_alphas = {name: alpha.detach().clone() for name, alpha in alphas[output].items()}
    if not parameters:
        return AlphaResult(best_lower, best_bounds, _whole(best_alphas, C.shape[0], partition), 0)

    optimizer = Adam([(parameters, lr)])
    done = 0
    for done in range(1, iterations + 1):
        if time_is_up():
            break
        if agree(stop_above is not None and bool((best_lower > stop_above).all())):
            break
        with torch.enable_grad():
            # The refined neurons' CROWN bounds replace the interval and earlier ones here (intersecting would take
            # the gradient away from the slopes that could make CROWN tighter still where those are tighter); the
            # neurons CROWN does not refine keep the tightest bounds known, not plain interval ones. Without
            # intermediate α those bounds do not change: the root's are used.
            bounds = start_bounds
            if intermediate:
                bounds = intermediate_bounds(
                    graph,
                    box,
                    alphas,
                    {pre: Interval(b.lower.detach(), b.upper.detach()) for pre, b in best_bounds.items()},
                    refined,
                    intersect_ibp=False,
                    partition=partition,
                )
            for pre, best in best_bounds.items():
                now = bounds[pre]
                best_bounds[pre] = Interval(
                    torch.fmax(best.lower, now.lower.detach()), torch.fmin(best.upper, now.upper.detach())
                )
            lower = spec_lower(graph, C, box, bounds, alphas[output], partition)
            # The same slopes over the tightest intermediate bounds known: the bound branch-and-bound starts from.
            lower_best = spec_lower(graph, C, box, best_bounds, alphas[output], partition)
            optimizer.zero_grad()
            # Sharded, each rank's objective is its own rows: the ranks' objectives sum to the whole, and the row
            # exchanges sum their gradients (replicated steps in between see only their rank's objective).
            mine = slice(None) if partition is None else partition.span(C.shape[0])
            objective = -(lower[mine].sum() + lower_best[mine].sum())
            if agree(not objective.requires_grad):  # no slope reaches the bound (constant relaxations cut it off)
                break
            objective.backward()
        with torch.no_grad():
            improved = (lower_best.detach() > best_lower)[mine]
            for name, alpha in alphas[output].items():
                mask = improved.view(*improved.shape, *([1] * (alpha.dim() - 2)))
                best_alphas[name] = torch.where(mask, alpha.detach(), best_alphas[name])
            best_lower = torch.fmax(best_lower, torch.fmax(lower.detach(), lower_best.detach()))  # NaN never wins
            optimizer.step()
            optimizer.scale_lr(lr_decay)
            for alpha in parameters:
                alpha.clamp_(0, 1)
    return AlphaResult(best_lower, best_bounds, _whole(best_alphas, C.shape[0], partition), done)


def _whole(alphas: dict[str, Tensor], rows: int, partition: RowPartition | None) -> dict[str, Tensor]:
    if partition is None:
        return alphas
    return {name: partition.gather(alpha, rows) for name, alpha in alphas.items()}
