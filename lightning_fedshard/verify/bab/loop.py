"""The branch-and-bound loop over neuron splits — ReLU phases, and the inputs of every other non-linear op
(GenBaB) — bounded by β-CROWN.

Best-first: each round takes the ``batch_size`` open domains with the lowest value, splits each on its chosen
neuron at its chosen point, bounds all children in one β-CROWN batch, drops the children that are proven, and
checks the minimising input corner of every open row for a counterexample (the "primal" point of the bound).
Every few rounds PGD starts from those corners too. ``unsat`` needs every domain proven. A domain with nothing
left to split that is not proven makes the answer ``unknown``: on a piecewise-linear graph after a longer β
optimisation that settles it exactly; on one with smooth operators at once (splitting only narrows their
intervals, so there is no finite end to it: GenBaB stops the same way).

Domain-parallel (``domain_group``): the ranks grow one search together until it has a few domains per rank,
then rank 0's domains are dealt out and every rank searches its share on its own, bounding ``1/P`` of the
batch per round, so the domains' slopes and multipliers (the memory of branch-and-bound) are spread over the
ranks. After every round the ranks agree on stopping: a counterexample, the deadline, or no domain left.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fedshard.verify.attack import pgd_attack
from lightning_fedshard.verify.bab.branching import choose_branches
from lightning_fedshard.verify.bab.domains import DomainBatch, DomainPool
from lightning_fedshard.verify.bounds.alpha import AlphaResult, iteration_bytes
from lightning_fedshard.verify.bounds.beta import beta_crown
from lightning_fedshard.verify.budget import current_budget, time_is_up
from lightning_fedshard.verify.config import Verdict, VerifyConfig
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.objective import OutputSpec, first_counterexample
from lightning_fedshard.verify.ops import Interval
from lightning_fedshard.verify.shard.lockstep import collective_device, lockstep
from lightning_fedshard.verify.syncs import note_round

__all__ = ["BabOutcome", "branch_and_bound"]

#: Minimising corners checked for a counterexample per round (the most negative rows first).
_PRIMAL_CHECKS = 512
#: Domain-parallel search: the shared start grows to this many domains per rank before they are dealt out.
_DOMAINS_PER_RANK_TO_DEAL = 4


@dataclass
class BabOutcome:
    """``verdict`` with its counterexample input (for ``sat``), the number of domains bounded, the deepest
    split depth reached and the open domains left."""

    verdict: Verdict
    counterexample: Tensor | None
    domains_bounded: int
    max_depth: int
    open_domains: int


def _primal_counterexample(graph: BoundGraph, spec: OutputSpec, corners: Tensor, margins: Tensor) -> Tensor | None:
    """The first minimising corner ``[S, N, *input]`` of an open row that is a real counterexample."""
    order = margins.T.flatten().argsort()[:_PRIMAL_CHECKS]
    order = order[margins.T.flatten()[order] <= 0]
    if not order.numel():
        return None
    return first_counterexample(graph, spec, corners.flatten(0, 1)[order])


def _settle(
    graph: BoundGraph,
    spec: OutputSpec,
    box: Interval,
    domains: DomainBatch,
    config: VerifyConfig,
) -> bool:
    """Whether domains with nothing left to split are proven after a longer β optimisation.

    On a piecewise-linear graph (``graph.exact_when_split``) the network is linear on such a domain and β-CROWN's
    bound converges to the exact minimum over it (+∞ where the splits contradict each other), but only slowly; a
    domain still open after this is left undecided. Elsewhere the relaxations stay loose: not settled.
    """
    if not graph.exact_when_split:
        return False
    n = len(domains)
    result = beta_crown(
        graph,
        box,
        spec.rows(n),
        domains,
        10 * config.beta_iterations,
        config.beta_lr_alpha,
        10 * config.beta_lr_beta,
        stop_above=spec.threshold.view(-1, 1).expand(-1, n),
    )
    margins = torch.fmax(spec.margins(result.lower), domains.margins)
    return bool((spec.value(margins) > 0).all())


class _DomainParallel:
    """The agreements of a domain-parallel search over ``group``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.rank, self.world = group, dist.get_rank(group), dist.get_world_size(group)
        self.device = collective_device(group)
        self.dealt = False

    def _reduce(self, values, op: dist.ReduceOp) -> list[int]:
        value = torch.tensor([int(v) for v in values], dtype=torch.long, device=self.device)
        dist.all_reduce(value, op=op, group=self.group)
        return value.tolist()

    def totals(self, *counts: int) -> list[int]:
        return self._reduce(counts, dist.ReduceOp.SUM)

    def maxima(self, *values: int) -> list[int]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def any(self, *flags: bool) -> list[bool]:
        return [bool(v) for v in self.maxima(*flags)]

    def first_counterexample(self, cex: Tensor | None) -> Tensor | None:
        found: list[Tensor | None] = [None] * self.world
        dist.all_gather_object(found, cex, group=self.group)
        return next((x for x in found if x is not None), None)

    def deal(self, pool: DomainPool, value) -> DomainPool | None:
        """This rank's share of rank 0's domains, worst first round-robin (``None`` if it gets none)."""
        held = [pool.pop_worst(len(pool), value) if self.rank == 0 else None]
        dist.broadcast_object_list(held, src=dist.get_global_rank(self.group, 0), group=self.group)
        mine = torch.arange(self.rank, len(held[0]), self.world, device=held[0].device)
        self.dealt = True
        return DomainPool(held[0].take(mine)) if mine.numel() else None


def branch_and_bound(
    graph: BoundGraph,
    spec: OutputSpec,
    box: Interval,
    root: AlphaResult,
    config: VerifyConfig,
    generator: torch.Generator | None = None,
    domain_group: dist.ProcessGroup | None = None,
) -> BabOutcome:
    """Decide the case that α-CROWN could not prove at the root (``root``: its bounds and slopes); with a
    ``domain_group`` the search is spread over its ranks (see the module docs)."""
    kept_names = sorted({consumer.name for consumer, _ in graph.splitter.values()})
    start = DomainBatch.at_root(graph, spec, root)
    with torch.no_grad():
        first = beta_crown(graph, box, spec.rows(1), start, iterations=0, keep=kept_names)
        if not graph.split_nodes:  # nothing to branch on: the root's bound is final, its corner the last candidate
            cex = _primal_counterexample(graph, spec, first.minimiser(box), start.margins)
            return BabOutcome(Verdict.UNKNOWN if cex is None else Verdict.SAT, cex, 1, 0, 1)
    if not choose_branches(graph, box, spec, start, first.kept, config.branching_candidates).all():
        return BabOutcome(Verdict.UNKNOWN, None, 0, 0, 1)
    parallel = _DomainParallel(domain_group) if domain_group is not None else None
    pool: DomainPool | None = DomainPool(start)
    # A parent's two children through β-CROWN with their gradients: the batch the memory budget allows.
    budget = current_budget()
    domain_bytes = 2 * iteration_bytes(graph, graph.output.name, spec.num_rows, 1, box.lower.dtype)
    # Domains bounded before the deal are the same on every rank and count once; after it, each rank's count.
    shared_bounded, own_bounded, max_depth, rounds, stuck = 0, 0, 0, 0, False

    def outcome(verdict: Verdict, cex: Tensor | None = None) -> BabOutcome:
        left = len(pool) if pool is not None else 0
        if parallel is None:
            return BabOutcome(verdict, cex, shared_bounded + own_bounded, max_depth, left)
        counted_here = parallel.rank == 0 or parallel.dealt
        bounded, open_left = parallel.totals(own_bounded, left if counted_here else 0)
        (deepest,) = parallel.maxima(max_depth)
        return BabOutcome(verdict, cex, shared_bounded + bounded, deepest, open_left)

    while True:
        size = len(pool) if pool is not None else 0
        # The clock is each rank's own: the deadline is agreed on (the ranks of a sharded search stop together).
        time_up, stuck_anywhere, any_open, total = time_is_up(), stuck, size > 0, size
        if parallel is not None:
            # Before the deal every rank holds the same domains, so rank 0 counts them.
            (total,) = parallel.totals(size if parallel.dealt or parallel.rank == 0 else 0)
            stuck_anywhere, any_open = parallel.any(stuck, any_open)
        if not any_open:
            return outcome(Verdict.UNKNOWN if stuck_anywhere else Verdict.UNSAT)
        if time_up:
            return outcome(Verdict.TIMEOUT)
        if total > config.max_domains:
            return outcome(Verdict.UNKNOWN)
        cex = None
        if size:
            dealt = parallel is not None and parallel.dealt
            batch = math.ceil(config.batch_size / parallel.world) if dealt else config.batch_size
            # Domain-parallel rounds are local: no rank waits for another inside them.
            with lockstep(None) if parallel is not None else nullcontext():
                if budget is not None:
                    batch = budget.items_per_chunk("bab", min(batch, size), domain_bytes)
                cex, count, depth, round_stuck = _round(
                    graph, spec, box, pool, batch, config, generator, rounds, kept_names, stuck
                )
            own_bounded, shared_bounded = (
                (own_bounded + count, shared_bounded) if dealt else (0, shared_bounded + count)
            )
            max_depth, stuck = max(max_depth, depth), stuck or round_stuck
        rounds += 1
        note_round()
        if parallel is not None:
            cex = parallel.first_counterexample(cex)
        if cex is not None:
            return outcome(Verdict.SAT, cex)
        if parallel is not None and not parallel.dealt and len(pool) >= _DOMAINS_PER_RANK_TO_DEAL * parallel.world:
            pool = parallel.deal(pool, spec.value)


def _round(
    graph: BoundGraph,
    spec: OutputSpec,
    box: Interval,
    pool: DomainPool,
    batch_size: int,
    config: VerifyConfig,
    generator: torch.Generator | None,
    rounds: int,
    kept_names: list[str],
    stuck: bool,
) -> tuple[Tensor | None, int, int, bool]:
    """One round: split the worst domains, bound the children, look for a counterexample, push the open ones.
    Returns the counterexample (or ``None``), the children bounded, their deepest depth and whether some domain
    could not be decided (once one could not, ``stuck``, the answer cannot be unsat and fully split domains are
    no longer settled)."""
    parents = pool.pop_worst(batch_size, spec.value)
    children = parents.split(graph.split_nodes, parents.branch_layer, parents.branch_neuron, parents.branch_point)
    n = len(children)
    budget = current_budget()
    with budget.measuring_if_tight("bab", len(parents)) if budget is not None else nullcontext():
        result = beta_crown(
            graph,
            box,
            spec.rows(n),
            children,
            config.beta_iterations,
            config.beta_lr_alpha,
            config.beta_lr_beta,
            stop_above=spec.threshold.view(-1, 1).expand(-1, n),
            keep=kept_names,
        )
    # A child's inputs are a subset of its parent's, so the parent's row bounds hold for it too.
    children.margins = torch.fmax(spec.margins(result.lower), children.margins)  # a NaN bound keeps the parent's
    depth = int(children.depth.max())
    corners = result.minimiser(box)
    cex = _primal_counterexample(graph, spec, corners, children.margins)
    if cex is None and config.attack_every and (rounds + 1) % config.attack_every == 0:
        worst = children.margins.T.flatten().argsort()[:8]
        starts = corners.flatten(0, 1)[worst]
        cex = pgd_attack(graph, spec, box, restarts=8, steps=20, starts=starts, generator=generator)
    if cex is not None:
        return cex, n, depth, False
    open_ = (~(spec.value(children.margins) > 0)).nonzero().flatten()  # NaN is open, never proven
    if not open_.numel():
        return None, n, depth, False
    children = children.take(open_)
    kept = {name: A[:, open_] for name, A in result.kept.items()}
    splittable = choose_branches(graph, box, spec, children, kept, config.branching_candidates)
    chosen = splittable.nonzero().flatten()  # its length says whether all are: one host sync, not two
    if len(chosen) < len(splittable):
        unsplittable = children.take((~splittable).nonzero().flatten())
        stuck = stuck or not _settle(graph, spec, box, unsplittable, config)
    pool.push(children.take(chosen))
    return None, n, depth, stuck
