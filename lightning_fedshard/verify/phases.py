"""The phases of verifying one case, each an entry point of its own: CROWN and α-CROWN at the root, and β-CROWN on
a batch of branch-and-bound domains, on a graph sharded by a :class:`~lightning_fedshard.verify.shard.plan.ShardPlan`.
For benchmarks and experiments that measure one phase at a time (``fedshard bench verify-memory``);
:func:`~lightning_fedshard.verify.verifier.verify` runs them, and more, under one deadline."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import Tensor

from lightning_fedshard.verify.bab.domains import DomainBatch
from lightning_fedshard.verify.bounds.alpha import AlphaResult, alpha_crown
from lightning_fedshard.verify.bounds.beta import beta_crown
from lightning_fedshard.verify.bounds.crown import intermediate_bounds, spec_lower
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.memory import tensor_bytes
from lightning_fedshard.verify.objective import OutputSpec, box_tensor
from lightning_fedshard.verify.shard.lockstep import lockstep
from lightning_fedshard.verify.shard.plan import ShardPlan
from lightning_fedshard.verify.spec import Case

__all__ = ["CasePhases"]


class CasePhases:
    """One case of a property on ``graph``, phase by phase. Sharded, every rank of ``plan.group`` builds it with
    its ``plan.shard(graph)`` and calls the same phases in the same order, inside :meth:`lockstep`.

    Example::

        phases = CasePhases(graph, prop.cases[0], plan)
        with phases.lockstep():
            margins = phases.crown()                 # [rows]: positive rules a row out
            root = phases.alpha(iterations=5)
            domains = phases.root_domains(root, 64)  # this rank's share of 64 copies of the root
            lower = phases.bab_batch(domains, iterations=5)
    """

    def __init__(self, graph: BoundGraph, case: Case, plan: ShardPlan | None = None) -> None:
        self.graph, self.plan = graph, plan or ShardPlan()
        self.box = box_tensor(
            case.box.lower, case.box.upper, graph.input.shape, graph.dtype, graph.device, graph.input_precision
        )
        self.spec = OutputSpec.from_case(case, graph.output.shape, graph.dtype, graph.device)

    def resident_bytes(self) -> int:
        """Bytes of the constants this rank holds (the full weights, or its shards)."""
        return tensor_bytes(self.graph.constants())

    def lockstep(self) -> AbstractContextManager[None]:
        """The group the phases take their decisions over (see :mod:`~lightning_fedshard.verify.shard.lockstep`)."""
        return lockstep(self.plan.lockstep_group)

    def crown(self) -> Tensor:
        """CROWN at the root: intermediate bounds, then the spec rows' margins ``M y − b`` (lower bounds)."""
        with torch.no_grad():
            bounds = intermediate_bounds(self.graph, self.box, partition=self.plan.partition)
            lower = spec_lower(self.graph, self.spec.rows(1), self.box, bounds, partition=self.plan.partition)
        return self.spec.margins(lower)[0]

    def alpha(self, iterations: int) -> AlphaResult:
        """α-CROWN at the root, ``iterations`` steps (no early stop)."""
        return alpha_crown(self.graph, self.box, self.spec.rows(1), iterations, partition=self.plan.partition)

    def root_domains(self, root: AlphaResult, count: int) -> DomainBatch:
        """``count`` copies of the unsplit root domain, as many as this rank bounds: row-parallel
        branch-and-bound deals its domains out over the ranks, the other plans bound all of them everywhere."""
        partition = self.plan.partition
        share = partition.counts(count)[partition.rank] if partition is not None else count
        return DomainBatch.at_root(self.graph, self.spec, root).repeat(share)

    @staticmethod
    def domain_bytes(domains: DomainBatch) -> int:
        """Bytes of a domain batch (its bounds, splits, α and β), resident while the batch is bounded."""
        return tensor_bytes(t for t, _ in domains._leaves())

    def bab_batch(self, domains: DomainBatch, iterations: int) -> Tensor:
        """One β-CROWN batch over ``domains`` (``iterations`` steps): the spec rows' lower bounds ``[S, N]``. A
        row-parallel rank bounds its own domains alone; the other plans in lockstep."""
        group = None if self.plan.row_parallel else self.plan.lockstep_group
        with self.plan.domain_search(self.graph), lockstep(group):
            return beta_crown(self.graph, self.box, self.spec.rows(len(domains)), domains, iterations).lower
