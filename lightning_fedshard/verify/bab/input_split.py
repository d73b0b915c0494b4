"""Branch and bound over the input box, for networks with few inputs (ACAS Xu has 5).

Where the input has few dimensions, splitting the box beats splitting ReLUs: every sub-box makes all bounds
tighter at once. Each round takes a batch of open boxes (last in, first out, so the open list stays as deep as the
search, not as wide; no more than fit the run's memory :class:`~lightning_fedshard.verify.budget.Budget`, nor than
the last round's pace allows in an eighth of the time left), bounds them together with CROWN (its intermediate
passes start from forward-mode bounds, :mod:`~lightning_fedshard.verify.bounds.forward`, which leave fewer neurons
to refine), and then per box:

* drops it if some spec row is proven (a box of one disjunct is safe once any of its rows is);
* runs the network on the minimising corner of every row's linear bound and on the centre, so counterexamples
  turn up where the bounds say they might be, and takes Newton steps from those nearest the unsafe set (a
  counterexample in a sliver next to a corner); every few rounds PGD starts in the worst boxes too;
* shrinks it to the part where the linear bounds allow a counterexample ("clip": every row's lower plane must be
  ``≤ rhs`` there, which confines each coordinate in closed form), dropping it if nothing is left;
* if it has few unstable ReLUs (and no other non-linear op), sets it aside to be tried piece by piece
  (:mod:`.pieces`) with others like it;
  a box a piece of which stays open is split like the rest;
* bisects it along the dimensions its branching rule ranks first, several at once while the batch has room
  (2^k children).

Which dimension to split decides the size of the search by orders of magnitude, and no rule is best everywhere
(measured on ACAS Xu, docs/verification.md), so several searches with different rules
(:class:`~lightning_fedshard.verify.config.InputBranching`) run side by side, one round each in turn, and the first
to finish decides: the cost is at most their number times the best one's.

A box whose every dimension is narrower than the float tolerance and still not decided is *stuck*: the answer
can then no longer be ``unsat``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_fedshard.verify.attack import newton_attack, pgd_attack
from lightning_fedshard.verify.bab.loop import BabOutcome
from lightning_fedshard.verify.bab.pieces import (
    PIECES_MAX_UNSTABLE,
    pieces_apply,
    prove_by_pieces,
)
from lightning_fedshard.verify.bounds.crown import Backward, backward_bound, intermediate_bounds, unstable_count
from lightning_fedshard.verify.bounds.forward import forward_bounds, forward_bytes_per_box
from lightning_fedshard.verify.budget import current_budget, seconds_left, time_is_up
from lightning_fedshard.verify.config import InputBranching, Verdict, VerifyConfig
from lightning_fedshard.verify.floats import round_outwards
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.objective import OutputSpec, first_counterexample, free_coordinates
from lightning_fedshard.verify.ops import Interval, flat
from lightning_fedshard.verify.shard.lockstep import DeadlineExceeded, agree_least
from lightning_fedshard.verify.syncs import note_round

__all__ = ["RootBounds", "input_split"]

#: sb: the coefficient floor (a dimension the bound ignores still gets split for its width).
_SB_COEFFICIENT_FLOOR = 1e-3
#: A dimension narrower than this fraction of its root width is not split further.
_MIN_RELATIVE_WIDTH = 1e-7
#: Clipped bounds move outwards by this fraction of the box width (float rounding must not cut a counterexample).
_CLIP_SLACK = 1e-5
#: trial: at most this many dimensions tried per round (the best by the sb score); ACAS Xu's 5 are all tried.
_TRIAL_DIMS = 16
#: PGD inside the search: the worst boxes attacked, and the steps each.
_ATTACK_BOXES, _ATTACK_STEPS = 16, 20
#: Each round, Newton steps start from this many of the candidate points nearest the unsafe set.
_NEWTON_POINTS = 32
#: Boxes with few unstable ReLUs wait for a batch of this many before they are tried piece by piece (one β-CROWN
#: optimisation costs about the same for one box as for hundreds).
_PIECES_BATCH = 256
#: The working memory of one bounding pass when the search runs outside a budget (called on its own, in tests).
_UNBUDGETED_PASS_BYTES = 2 << 30
#: A round of the search takes at most this share of the time left (by the pace of its last round).
_ROUND_SHARE = 1 / 8
#: The searches' last rounds whose bounds are kept: a search popping the very boxes another has just bounded
#: (both start at the root; on a conv net, one box per round, the rules often split alike) takes them.
_SHARED_ROUNDS = 16


@dataclass(frozen=True)
class RootBounds:
    """The root box's intermediate bounds from the verifier's own CROWN pass, and the seconds that pass took: the
    first round of every search uses them instead of bounding the root again (on a conv net that takes as long
    as a round of children), and sizes the next round by them.

    Example::

        input_split(graph, spec, box, config, known_root=RootBounds(bounds, seconds=crown_seconds))
    """

    bounds: Mapping[str, Interval]
    seconds: float


@dataclass
class _Boxes:
    """``N`` boxes of the flat input: ``lower``/``upper`` ``[N, d]`` and the split depth ``[N]``."""

    lower: Tensor
    upper: Tensor
    depth: Tensor

    def __len__(self) -> int:
        return self.lower.shape[0]

    def take(self, index: Tensor) -> _Boxes:
        """The boxes at ``index`` (positions, or a boolean mask: turned into positions once, one host sync on a GPU
        rather than one per field)."""
        index = index.nonzero().flatten() if index.dtype == torch.bool else index
        return _Boxes(self.lower[index], self.upper[index], self.depth[index])

    def interval(self, shape: tuple[int, ...]) -> Interval:
        return Interval(self.lower.view(-1, *shape), self.upper.view(-1, *shape))


class _BoxStack:
    """Open boxes, last in first out, in tensors that grow by doubling."""

    def __init__(self, first: _Boxes) -> None:
        self._storage, self._size = first, len(first)

    def __len__(self) -> int:
        return self._size

    def push(self, boxes: _Boxes) -> None:
        end = self._size + len(boxes)
        if end > len(self._storage):
            grown = max(2 * len(self._storage), end)
            self._storage = _Boxes(
                *(torch.cat([t, t.new_zeros(grown - len(t), *t.shape[1:])]) for t in vars(self._storage).values())
            )
        for name, value in vars(boxes).items():
            getattr(self._storage, name)[self._size : end] = value
        self._size = end

    def pop(self, count: int) -> _Boxes:
        start = max(self._size - count, 0)
        taken = _Boxes(*(t[start : self._size].clone() for t in vars(self._storage).values()))
        self._size = start
        return taken


def _bound(
    graph: BoundGraph,
    spec: OutputSpec,
    boxes: Interval,
    known: Mapping[str, Interval] | None = None,
) -> tuple[Backward, dict[str, Interval]]:
    """CROWN over the spec rows, and the intermediate bounds it used (``known`` ones where given: the root box's from
    the verifier's own CROWN pass); both passes stop at the run's deadline (one batch of a large net takes seconds)."""
    bounds = dict(known) if known is not None else intermediate_bounds(graph, boxes, forward=True)
    rows = spec.rows(boxes.lower.shape[0])
    return backward_bound(graph, graph.output.name, rows, boxes, bounds), bounds


def _planes(out: Backward, boxes: _Boxes) -> tuple[Tensor, Tensor]:
    """Each row's lower linear bound ``A x + c`` over the boxes: ``A [S, N, d]``, ``c [S, N]`` (float64); ``A`` is 0
    where the bound does not depend on the input (a step's constant relaxation cut every path to it)."""
    if out.input_A is None:
        A = torch.zeros(*out.lower.shape, boxes.lower[0].numel(), dtype=torch.float64)
    else:
        A = flat(out.input_A, 2).double()
    minimum = torch.where(A >= 0, A * boxes.lower.double(), A * boxes.upper.double()).sum(-1)
    return A, out.lower.double() - minimum


def _clip(boxes: _Boxes, A: Tensor, c: Tensor, rhs: Tensor) -> tuple[_Boxes, Tensor]:
    """The boxes shrunk to where every row's plane stays ``≤ rhs`` (a counterexample needs all rows of its
    disjunct ``≤ 0``, and the plane is below the row), and which boxes are not empty."""
    lower, upper = boxes.lower.double(), boxes.upper.double()
    term_min = torch.where(A >= 0, A * lower, A * upper)  # [S, N, d]
    rest = c.unsqueeze(-1) + term_min.sum(-1, keepdim=True) - term_min  # min over the other coordinates
    limit = (rhs.double().view(-1, 1, 1) - rest) / torch.where(A == 0, 1.0, A)
    # A plane that is not a number (an infinite bound times a zero width, ∞ − ∞) cuts nothing: the box stays whole,
    # where a NaN limit would have made it look empty and dropped it unproven.
    new_upper = torch.where((A > 0) & ~limit.isnan(), limit, torch.inf).amin(0)
    new_lower = torch.where((A < 0) & ~limit.isnan(), limit, -torch.inf).amax(0)
    slack = _CLIP_SLACK * (upper - lower) + 1e-12
    new_lower = torch.maximum(lower, new_lower - slack)
    new_upper = torch.minimum(upper, new_upper + slack)
    keep = (new_lower <= new_upper).all(1)
    lo, hi = round_outwards(new_lower, new_upper, boxes.lower.dtype)
    return _Boxes(lo, hi, boxes.depth), keep


def _sb_scores(A: Tensor, margins: Tensor, boxes: _Boxes) -> Tensor:
    width = (boxes.upper - boxes.lower).double()
    gain = A.abs().clamp(min=_SB_COEFFICIENT_FLOOR) * width / 2 + margins.T.double().unsqueeze(-1)
    return gain.amax(0)


def _trial_scores(
    graph: BoundGraph,
    spec: OutputSpec,
    boxes: _Boxes,
    splittable: Tensor,
    sb: Tensor,
    boxes_per_pass: int,
) -> Tensor:
    """Per box and dimension, the shortfall below zero of both halves' forward-mode values (higher is better); of
    more than ``_TRIAL_DIMS`` dimensions only those the *sb* scores ``sb`` rank first over the batch are tried. The
    halves are bounded ``boxes_per_pass`` at a time (there are ``2 × dimensions × boxes`` of them: on a conv net
    all at once would take tens of gigabytes), each pass stopping at the run's deadline."""
    n, d = boxes.lower.shape
    dims = splittable.any(0).nonzero().flatten()
    if dims.numel() > _TRIAL_DIMS:
        ranked = torch.where(splittable, sb, -torch.inf).amax(0)[dims]
        dims = dims[ranked.topk(_TRIAL_DIMS).indices]
    every = torch.arange(n, device=dims.device).repeat(len(dims))
    halves = _split(boxes.take(every), dims.repeat_interleave(n).unsqueeze(1))
    lower = []
    for chunk in torch.arange(len(halves), device=dims.device).split(boxes_per_pass):
        interval = halves.take(chunk).interval(graph.input.shape)
        bounds = forward_bounds(graph, interval)
        rows = spec.rows(len(chunk))
        lower.append(backward_bound(graph, graph.output.name, rows, interval, bounds).lower)
    value = spec.value(spec.margins(torch.cat(lower, 1))).clamp(max=0).double().view(2, len(dims), n).sum(0)
    scores = torch.full((n, d), -torch.inf, dtype=torch.float64, device=value.device)
    scores[:, dims] = value.T
    return scores


def _split(boxes: _Boxes, dims: Tensor) -> _Boxes:
    """The ``2^k`` children of each box bisected along its ``dims [N, k]`` (child ``c`` of box ``i`` is row
    ``c·N + i``)."""
    n, k = dims.shape
    children = 1 << k
    lower, upper = boxes.lower.repeat(children, 1), boxes.upper.repeat(children, 1)
    rows = torch.arange(n * children, device=dims.device)
    combo = rows // n
    dims = dims.repeat(children, 1)
    for j in range(k):
        dim = dims[:, j]
        lo, hi = lower[rows, dim], upper[rows, dim]
        mid = lo + (hi - lo) / 2
        upper_half = ((combo >> j) & 1).bool()
        lower[rows, dim] = torch.where(upper_half, mid, lo)
        upper[rows, dim] = torch.where(upper_half, hi, mid)
    return _Boxes(lower, upper, boxes.depth.repeat(children) + k)


class _Search:
    """One search over sub-boxes of the root with its own branching rule: the open boxes, and those with few
    unstable ReLUs waiting to be tried piece by piece (in batches: one β-CROWN optimisation costs about the same
    for one box as for hundreds), and the time its last round took per box."""

    def __init__(self, root: _Boxes, branching: InputBranching) -> None:
        self.stack, self.phases, self.branching = _BoxStack(root), _BoxStack(root.take(root.depth[:0])), branching
        self.rounds, self.stuck, self.seconds_per_box = 0, False, 0.0

    def __len__(self) -> int:
        return len(self.stack) + len(self.phases)

    def observe(self, seconds: float, boxes: int) -> None:
        self.seconds_per_box = seconds / boxes

    def affordable(self, batch: int) -> int:
        """Boxes for a round that takes at most ``_ROUND_SHARE`` of the time left at the last round's pace (at
        least 1, at most ``batch``). On ACAS Xu a box takes microseconds and this is ``batch``; on a conv net
        where one box takes seconds, a full batch of children would outlast the deadline in its first round."""
        affordable, left = batch, seconds_left()
        if self.seconds_per_box and math.isfinite(left):
            affordable = max(1, min(batch, int(_ROUND_SHARE * left / self.seconds_per_box)))
        # Sharded, the ranks' clocks differ but their rounds must hold the same boxes: the least of them.
        return agree_least(affordable)


def _pace(from_root: RootBounds | None, started: float) -> float:
    """Seconds of a round so far, or of the root pass its known bounds stand in for."""
    return from_root.seconds if from_root is not None else time.monotonic() - started


def input_split(
    graph: BoundGraph,
    spec: OutputSpec,
    box: Interval,
    config: VerifyConfig,
    generator: torch.Generator | None = None,
    known_root: RootBounds | None = None,
) -> BabOutcome:
    """Decide ``spec`` (one disjunct: all its rows must be ``≤ 0`` for a counterexample) over ``box [1, *input]``
    by splitting the box (see the module docs), starting from the root box's ``known_root`` bounds where given. Every
    pass of the search stops at the run's deadline: the answer is then ``timeout``."""
    shape = graph.input.shape
    root = _Boxes(flat(box.lower, 1), flat(box.upper, 1), torch.zeros(1, dtype=torch.long, device=box.lower.device))
    min_width = (root.upper - root.lower).double() * _MIN_RELATIVE_WIDTH
    searches = [_Search(root, branching) for branching in config.input_branching]
    free_dims = int(free_coordinates(box).sum())
    per_box, budget = forward_bytes_per_box(graph, free_dims), current_budget()
    boxes_per_pass = budget.items_that_fit(per_box, 1 << 62) if budget else max(1, _UNBUDGETED_PASS_BYTES // per_box)
    batch = min(config.input_batch_size, boxes_per_pass)
    bounded, max_depth = 0, 0
    recent: dict[bytes, tuple[Backward, dict[str, Interval]]] = {}  # the last rounds' bounds, by their boxes

    def outcome(verdict: Verdict, cex: Tensor | None = None) -> BabOutcome:
        return BabOutcome(verdict, cex, bounded, max_depth, min(len(s) for s in searches))

    try:
        for turn in range(1 << 62):
            search = searches[turn % len(searches)]
            if not len(search):
                return outcome(Verdict.UNKNOWN if search.stuck else Verdict.UNSAT)
            if time_is_up():
                return outcome(Verdict.TIMEOUT)
            if len(search) > config.max_input_domains:
                return outcome(Verdict.UNKNOWN)
            by_phases = len(search.phases) >= _PIECES_BATCH or not len(search.stack)
            if by_phases:
                boxes = search.phases.pop(min(_PIECES_BATCH, boxes_per_pass))
            else:
                boxes = search.stack.pop(search.affordable(batch))
            started, interval = time.monotonic(), boxes.interval(shape)
            from_root = known_root if not search.rounds else None
            key = torch.cat([boxes.lower, boxes.upper]).cpu().numpy().tobytes()
            shared = recent.get(key)
            paced = shared is None or from_root is not None  # a shared round costs nothing: not this search's pace
            with torch.no_grad():
                if shared is None:
                    known = from_root.bounds if from_root is not None else None
                    out, bounds = _bound(graph, spec, interval, known)
                    bounded += len(boxes)
                    recent[key] = out, bounds
                    if len(recent) > _SHARED_ROUNDS:
                        del recent[next(iter(recent))]
                else:
                    out, bounds = shared
                margins = spec.margins(out.lower)  # [N, S]
                cex = _candidates(graph, spec, out, interval)
            if paced:
                search.observe(_pace(from_root, started), len(boxes))
            max_depth = max(max_depth, int(boxes.depth.max()))
            search.rounds += 1
            note_round()
            if cex is None and config.attack_every and search.rounds % config.attack_every == 0:
                worst = spec.value(margins).argsort()[:_ATTACK_BOXES]
                worst_boxes = boxes.take(worst).interval(shape)
                cex = pgd_attack(graph, spec, worst_boxes, 1, _ATTACK_STEPS, generator=generator)
            if cex is not None:
                return outcome(Verdict.SAT, cex.reshape(shape))
            with torch.no_grad():
                open_ = ~(spec.value(margins) > 0)  # NaN is open, never proven
                if by_phases:
                    cex = _try_phases(graph, spec, boxes, out, bounds, open_)
                else:
                    few = open_ & (unstable_count(graph, bounds) <= PIECES_MAX_UNSTABLE) & pieces_apply(graph)
                    search.phases.push(boxes.take(few))
                    open_ &= ~few
                if cex is not None:
                    return outcome(Verdict.SAT, cex.reshape(shape))
                next_batch = search.affordable(batch)
                children = _branch(
                    graph, spec, boxes, out, margins, open_, min_width, search, next_batch, boxes_per_pass
                )
            if paced:
                search.observe(_pace(from_root, started), len(boxes))
            if children is not None:
                search.stack.push(children)
    except DeadlineExceeded:  # inside a pass: the search's answer is the same as at a check between batches
        return outcome(Verdict.TIMEOUT)
    raise AssertionError("unreachable")


def _candidates(graph: BoundGraph, spec: OutputSpec, out: Backward, boxes: Interval) -> Tensor | None:
    """A counterexample among the boxes' centres and the minimising corners of their rows' linear bounds, or by
    Newton steps from the ``_NEWTON_POINTS`` of them nearest the unsafe set (see :func:`newton_attack`)."""
    n = boxes.lower.shape[0]
    points = torch.cat([boxes.center, out.minimiser(boxes).flatten(0, 1)])
    value = spec.point_value(graph(points))
    cex = first_counterexample(graph, spec, points, value)
    if cex is not None:
        return cex
    nearest = value.nan_to_num(torch.inf).argsort()[:_NEWTON_POINTS]
    owner = nearest % n  # point i of the centres and each row's corners lies in box i mod n
    return newton_attack(graph, spec, points[nearest], Interval(boxes.lower[owner], boxes.upper[owner]))


def _try_phases(
    graph: BoundGraph,
    spec: OutputSpec,
    boxes: _Boxes,
    out: Backward,
    bounds: dict[str, Interval],
    open_: Tensor,
) -> Tensor | None:
    """The open boxes with few unstable ReLUs tried piece by piece; the proven ones are marked closed in ``open_``
    (the others go on to be split). Returns a counterexample if a piece's minimising corner is one."""
    index = (open_ & (unstable_count(graph, bounds) <= PIECES_MAX_UNSTABLE)).nonzero().flatten()
    if not index.numel():
        return None
    chosen = {name: Interval(b.lower[index], b.upper[index]) for name, b in bounds.items()}
    proven, cex = prove_by_pieces(
        graph, spec, boxes.take(index).interval(graph.input.shape), chosen, out.lower[:, index]
    )
    open_[index[proven]] = False
    return cex


def _branch(
    graph: BoundGraph,
    spec: OutputSpec,
    boxes: _Boxes,
    out: Backward,
    margins: Tensor,
    open_: Tensor,
    min_width: Tensor,
    search: _Search,
    batch: int,
    boxes_per_pass: int,
) -> _Boxes | None:
    """The children of the ``open_`` boxes: clipped, then split by the search's rule (``None``: none left)."""
    open_ = open_.nonzero().flatten()
    if not open_.numel():
        return None
    A, c = _planes(out, boxes)
    boxes, margins, A, c = boxes.take(open_), margins[open_], A[:, open_], c[:, open_]
    # Boolean masks become indices once: each mask used as an index is a nonzero, and a host sync on a GPU.
    boxes, keep = _clip(boxes, A, c, spec.exact[1] + spec.row_slack)
    keep = keep.nonzero().flatten()
    boxes, margins, A = boxes.take(keep), margins[keep], A[:, keep]
    wide = (boxes.upper - boxes.lower).double() > min_width
    splittable = wide.any(1).nonzero().flatten()
    search.stuck = search.stuck or len(splittable) < len(boxes)
    boxes, margins, A, wide = boxes.take(splittable), margins[splittable], A[:, splittable], wide[splittable]
    if not len(boxes):
        return None
    scores = _sb_scores(A, margins, boxes)
    if search.branching is InputBranching.TRIAL:
        scores = _trial_scores(graph, spec, boxes, wide, scores, boxes_per_pass)
    scores = torch.where(wide, scores, -torch.inf)
    # Split along as many dimensions as keep the next batch within its size (at least one).
    k = max(1, min(int(math.log2(max(batch // len(boxes), 1))), int(wide.sum(1).min())))
    dims = scores.topk(k, dim=1).indices
    return _split(boxes, dims)
