"""One instance end to end: attack, then ever stronger bounds, then branch-and-bound; a verdict out."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lightning_fedshard.verify.attack import pgd_attack
from lightning_fedshard.verify.bab.loop import branch_and_bound
from lightning_fedshard.verify.bounds.alpha import alpha_crown
from lightning_fedshard.verify.bounds.crown import intermediate_bounds, spec_lower
from lightning_fedshard.verify.config import Method, Verdict, VerifyConfig
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.memory import PeakMemoryMeter, tensor_bytes
from lightning_fedshard.verify.objective import OutputSpec, box_tensor
from lightning_fedshard.verify.onnx_loader import load_onnx
from lightning_fedshard.verify.ops import Interval
from lightning_fedshard.verify.shard.lockstep import lockstep, past
from lightning_fedshard.verify.shard.plan import ShardPlan
from lightning_fedshard.verify.spec import Case, Counterexample, Property, check_counterexample, read_vnnlib

__all__ = ["InstanceLoadError", "VerificationResult", "model_forward", "verify", "verify_files"]


class InstanceLoadError(ValueError):
    """An instance of a sharded run could not be loaded on some rank; raised on every rank of the group before
    any bound is computed, so the ranks can report it and go on to the next instance together."""


@dataclass
class VerificationResult:
    """The answer for one instance.

    ``root_margins[c][r]``: lower bound of spec row ``r`` of case ``c`` by the strongest root method run
    (``M y − b``; positive rules its disjunct out). ``decided_by``: ``"pgd"``, ``"ibp"``, ``"crown"``,
    ``"alpha-crown"``, ``"bab"`` (or ``None``); ``times``: seconds per phase. Memory of this rank (see
    :class:`~lightning_fedshard.verify.memory.PeakMemoryMeter`): ``baseline_memory_bytes`` before propagation
    (the constants it holds: full weights, or its shards) and ``peak_memory_bytes`` during it (both 0 unless
    ``config.measure_memory``); ``rss_peak_bytes`` is the process's resident high-water mark since it started.

    Example::

        result = verify_files("net.onnx", "prop.vnnlib", VerifyConfig(timeout=60))
        result.verdict, result.counterexample
    """

    verdict: Verdict
    counterexample: Counterexample | None = None
    decided_by: str | None = None
    root_margins: list[list[float]] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)
    baseline_memory_bytes: int = 0
    peak_memory_bytes: int = 0
    rss_peak_bytes: int = 0
    domains_bounded: int = 0
    max_depth: int = 0
    #: For a ``sat`` from :func:`verify_files`: ``"ok"`` once the counterexample replayed on the ONNX model.
    counterexample_check: str = ""

    def to_report(self) -> dict:
        """The JSON-able report ``fedshard verify --report`` writes."""
        return {
            "verdict": self.verdict.value,
            "decided_by": self.decided_by,
            "root_margins": self.root_margins,
            "times_s": self.times,
            "total_time_s": sum(self.times.values()),
            "baseline_memory_bytes": self.baseline_memory_bytes,
            "peak_memory_bytes": self.peak_memory_bytes,
            "rss_peak_bytes": self.rss_peak_bytes,
            "domains_bounded": self.domains_bounded,
            "max_depth": self.max_depth,
            **({"counterexample_check": self.counterexample_check} if self.counterexample_check else {}),
        }


class _Run:
    """Bookkeeping of one ``verify`` call: phase timing and the overall deadline."""

    def __init__(self, timeout: float) -> None:
        self.deadline = time.monotonic() + timeout
        self.times: dict[str, float] = {}

    def timed(self, phase: str, fn, *args, **kwargs):
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self.times[phase] = self.times.get(phase, 0.0) + time.monotonic() - start

    @property
    def expired(self) -> bool:
        """Whether the budget ran out (on any rank of a sharded run: they all stop together)."""
        return past(self.deadline)


def _counterexample(graph: BoundGraph, x: torch.Tensor) -> Counterexample:
    with torch.no_grad():
        y = graph(x.unsqueeze(0))[0]
    return Counterexample(x.double().flatten().numpy(), y.double().flatten().numpy())


def _ibp_margins(graph: BoundGraph, spec: OutputSpec, box: Interval) -> torch.Tensor:
    out = graph.ibp(box)[graph.output.name]
    lower, upper = out.lower.flatten(1), out.upper.flatten(1)
    M = spec.matrix
    return (lower @ M.clamp(min=0).T + upper @ M.clamp(max=0).T - spec.rhs)[0]


def _verify_case(
    graph: BoundGraph, case: Case, config: VerifyConfig, plan: ShardPlan, run: _Run, generator: torch.Generator
) -> tuple[Verdict, torch.Tensor | None, str | None, list[float], dict]:
    """Verdict, counterexample input, deciding method, root margins and BaB statistics for one case."""
    box = box_tensor(case.box.lower, case.box.upper, graph.input.shape, graph.dtype)
    if any(len(d.rhs) == 0 for d in case.disjuncts):  # an unconstrained disjunct: every output is unsafe
        return Verdict.SAT, box.center[0], "pgd", [], {}
    spec = OutputSpec.from_case(case, graph.output.shape, graph.dtype)
    with torch.no_grad():
        x = run.timed(
            "attack",
            pgd_attack,
            graph,
            spec,
            box,
            config.attack_restarts,
            config.attack_steps,
            generator=generator,
            deadline=run.deadline,
        )
    if x is not None:
        return Verdict.SAT, x, "pgd", [], {}

    def proven(margins: torch.Tensor) -> bool:
        return bool(spec.value(margins.view(1, -1)) > 0)

    with torch.no_grad():
        margins = run.timed("ibp", _ibp_margins, graph, spec, box)
    if proven(margins):
        return Verdict.UNSAT, None, "ibp", margins.tolist(), {}
    if config.method is Method.IBP:
        return Verdict.UNKNOWN, None, None, margins.tolist(), {}

    partition = plan.partition

    def crown() -> torch.Tensor:
        bounds = intermediate_bounds(graph, box, intersect_ibp=config.intersect_ibp, partition=partition)
        return spec_lower(graph, spec.rows(1), box, bounds, partition=partition)[:, 0] - spec.rhs

    with torch.no_grad():
        margins = run.timed("crown", crown)
    if proven(margins):
        return Verdict.UNSAT, None, "crown", margins.tolist(), {}
    if config.method is Method.CROWN or run.expired:
        return (Verdict.TIMEOUT if run.expired else Verdict.UNKNOWN), None, None, margins.tolist(), {}

    root = run.timed(
        "alpha-crown",
        alpha_crown,
        graph,
        box,
        spec.rows(1),
        config.alpha_iterations,
        config.alpha_lr,
        config.alpha_lr_decay,
        stop_above=spec.rhs.view(-1, 1),
        deadline=run.deadline,
        intersect_ibp=config.intersect_ibp,
        partition=partition,
    )
    margins = root.lower[:, 0] - spec.rhs
    if proven(margins):
        return Verdict.UNSAT, None, "alpha-crown", margins.tolist(), {}
    if config.method is Method.ALPHA_CROWN or run.expired:
        return (Verdict.TIMEOUT if run.expired else Verdict.UNKNOWN), None, None, margins.tolist(), {}

    # Each disjunct not ruled out at the root gets its own search (α,β-CROWN does the same per target label): the
    # branching then serves one objective, and the rows already proven cost nothing more.
    open_disjuncts = [d for d in range(spec.num_disjuncts) if float(margins[spec.rows_of(d)].max()) <= 0]
    open_disjuncts.sort(key=lambda d: float(margins[spec.rows_of(d)].max()))
    stats = {"domains_bounded": 0, "max_depth": 0}
    verdict = Verdict.UNSAT
    for d in open_disjuncts:
        rows = spec.rows_of(d)
        outcome = run.timed(
            "bab",
            branch_and_bound,
            graph,
            spec.only(d),
            box,
            root.rows(rows),
            config,
            run.deadline,
            generator,
            plan.domain_group,
        )
        stats["domains_bounded"] += outcome.domains_bounded
        stats["max_depth"] = max(stats["max_depth"], outcome.max_depth)
        if outcome.verdict in (Verdict.SAT, Verdict.TIMEOUT):
            verdict = outcome.verdict
            break
        if outcome.verdict is Verdict.UNKNOWN:
            verdict = Verdict.UNKNOWN  # keep searching the other disjuncts for a counterexample
    outcome_cex = outcome.counterexample if verdict is Verdict.SAT else None
    decided = "bab" if verdict in (Verdict.SAT, Verdict.UNSAT) else None
    return verdict, outcome_cex, decided, margins.tolist(), stats


def verify(
    graph: BoundGraph, prop: Property, config: VerifyConfig | None = None, plan: ShardPlan | None = None
) -> VerificationResult:
    """Decide ``prop`` on ``graph``: ``sat`` if some case has a counterexample, ``unsat`` if every case is
    proven, else ``unknown`` (or ``timeout`` when the budget ran out).

    The counterexample of a ``sat`` answer has been replayed on ``graph``; check it on the ONNX model with
    :func:`~lightning_fedshard.verify.spec.check_counterexample`. A sharded run (``plan``) is called on every
    rank of ``plan.group`` with ``plan.shard(graph)`` and returns the same answer on all of them.
    """
    config = config or VerifyConfig()
    plan = plan or ShardPlan()
    if prop.num_inputs != graph.input.size or prop.num_outputs != graph.output.size:
        raise ValueError(
            f"the property has {prop.num_inputs} inputs and {prop.num_outputs} outputs, the network "
            f"{graph.input.size} and {graph.output.size}"
        )
    run = _Run(config.timeout)
    generator = torch.Generator().manual_seed(config.seed)
    result = VerificationResult(Verdict.UNSAT)
    meter = PeakMemoryMeter(graph.device, tensor_bytes(graph.constants())) if config.measure_memory else None
    with lockstep(plan.lockstep_group), meter if meter is not None else nullcontext():
        if meter is not None:
            meter.mark_baseline()
        for case in prop.cases:
            if _decide_case(graph, case, config, plan, run, generator, result):
                break
    if result.verdict is not Verdict.UNSAT and result.verdict is not Verdict.SAT:
        result.decided_by = None
    result.times = run.times
    if meter is not None:
        result.baseline_memory_bytes, result.peak_memory_bytes = meter.baseline_bytes, meter.peak_bytes
    result.rss_peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def _decide_case(
    graph: BoundGraph,
    case: Case,
    config: VerifyConfig,
    plan: ShardPlan,
    run: _Run,
    generator: torch.Generator,
    result: VerificationResult,
) -> bool:
    """Folds the answer for one case into ``result``; true once the property is falsified."""
    verdict, x, decided_by, margins, stats = _verify_case(graph, case, config, plan, run, generator)
    result.root_margins.append(margins)
    result.domains_bounded += stats.get("domains_bounded", 0)
    result.max_depth = max(result.max_depth, stats.get("max_depth", 0))
    if verdict is Verdict.SAT:
        result.verdict, result.decided_by = Verdict.SAT, decided_by
        result.counterexample = _counterexample(graph, x)
        return True
    if verdict is not Verdict.UNSAT:
        # Keep looking for a counterexample in the other cases; the answer can no longer be unsat.
        result.verdict = verdict if result.verdict is Verdict.UNSAT else result.verdict
    elif result.verdict is Verdict.UNSAT:
        result.decided_by = decided_by
    return False


def verify_files(
    onnx_path: str | Path,
    vnnlib_path: str | Path,
    config: VerifyConfig | None = None,
    plan: ShardPlan | None = None,
) -> VerificationResult:
    """:func:`verify` on files: an ONNX model (``.onnx``/``.onnx.gz``) and a VNN-LIB property, with
    ``config.timeout`` counting the loading too.

    A ``sat`` counterexample is replayed on the ONNX model (:func:`model_forward`) and checked against the
    property as the VNN-COMP scorer does; one that fails (which would be a bug) turns the answer into
    ``unknown``, the reason kept in ``counterexample_check``.

    Sharded (``plan``), every rank of the group calls it with the same files; the model is sharded right after
    loading, and a file that fails to load on any rank raises :class:`InstanceLoadError` on all of them before
    any bound is computed. Any later error is this rank's alone: it must end the run (the other ranks' next
    collective then fails), never be caught and skipped, or the ranks' collectives would no longer match.
    """
    config, plan = config or VerifyConfig(), plan or ShardPlan()
    start = time.monotonic()
    graph, prop = _load_everywhere(onnx_path, vnnlib_path, plan)
    sharded = plan.shard(graph)
    if sharded is not graph:
        graph = None  # this rank keeps its shards only
    load_time = time.monotonic() - start
    result = verify(sharded, prop, replace(config, timeout=max(config.timeout - load_time, 1e-3)), plan)
    result.times = {"load": load_time, **result.times}
    if result.verdict is Verdict.SAT:
        check = check_counterexample(result.counterexample, prop, model_forward(onnx_path, graph))
        result.counterexample_check = check.reason
        if not check.ok:
            result.verdict, result.decided_by, result.counterexample = Verdict.UNKNOWN, None, None
    return result


def _load_everywhere(onnx_path: str | Path, vnnlib_path: str | Path, plan: ShardPlan) -> tuple[BoundGraph, Property]:
    error: Exception | None = None
    try:
        graph = load_onnx(onnx_path)
        prop = read_vnnlib(vnnlib_path, graph.input.size, graph.output.size)
    except Exception as exc:  # noqa: BLE001 (re-raised below, on every rank of a sharded run)
        error = exc
    if plan.sharded:
        messages: list[str | None] = [None] * dist.get_world_size(plan.group)
        dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}", plan.group)
        failed = [(rank, message) for rank, message in enumerate(messages) if message is not None]
        if failed:
            rank, message = failed[0]
            raise InstanceLoadError(f"rank {rank} of the sharded group could not load the instance: {message}")
    if error is not None:
        raise error
    return graph, prop


def model_forward(onnx_path: str | Path, graph: BoundGraph | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """Flat-input forward pass on the ONNX model for replaying counterexamples: onnxruntime where installed
    (independent of our loader), else the loaded graph."""
    try:
        import onnxruntime
    except ImportError:
        graph = graph if graph is not None else load_onnx(onnx_path)

        def run_graph(x: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                return graph(torch.as_tensor(x, dtype=graph.dtype).view(1, -1)).double().numpy().ravel()

        return run_graph
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (inp,) = session.get_inputs()
    shape = [1 if not isinstance(d, int) else d for d in inp.shape]

    def run_session(x: np.ndarray) -> np.ndarray:
        return (
            session.run(None, {inp.name: np.asarray(x, dtype=np.float32).reshape(shape)})[0].astype(np.float64).ravel()
        )

    return run_session
