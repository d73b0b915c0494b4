"""One instance end to end: attack, then ever stronger bounds, then branch-and-bound; a verdict out."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from lightning_fedshard._torch_compat import require_extra
from lightning_fedshard.verify import syncs
from lightning_fedshard.verify.attack import pgd_attack
from lightning_fedshard.verify.bab.input_split import RootBounds, input_split
from lightning_fedshard.verify.bab.loop import branch_and_bound
from lightning_fedshard.verify.bounds.alpha import AlphaResult, alpha_crown
from lightning_fedshard.verify.bounds.crown import intermediate_bounds, open_neurons, spec_lower
from lightning_fedshard.verify.budget import Budget, MemoryBudgetExceeded, peak_resident_bytes
from lightning_fedshard.verify.config import BabMode, Method, Refine, Verdict, VerifyConfig
from lightning_fedshard.verify.device import full_precision, resolve_device
from lightning_fedshard.verify.floats import FLOAT64_EPSILON, round_down
from lightning_fedshard.verify.graph import BoundGraph
from lightning_fedshard.verify.memory import PeakMemoryMeter, tensor_bytes
from lightning_fedshard.verify.objective import OutputSpec, box_tensor, free_coordinates
from lightning_fedshard.verify.onnx import UnsupportedModelError, load_onnx, onnx_source
from lightning_fedshard.verify.ops import Interval, flat
from lightning_fedshard.verify.result import VerificationResult
from lightning_fedshard.verify.shard.lockstep import DeadlineExceeded, agree_least, lockstep
from lightning_fedshard.verify.shard.plan import ShardPlan
from lightning_fedshard.verify.spec import (
    Case,
    Counterexample,
    Property,
    UnsupportedPropertyError,
    check_counterexample,
    read_vnnlib,
)

if TYPE_CHECKING:  # the LP module needs highspy, imported where a run refines its bounds
    from lightning_fedshard.verify.bounds.lp import RefineStats

__all__ = ["InstanceLoadError", "VerificationResult", "model_forward", "prepare_files", "verify", "verify_files"]


class InstanceLoadError(ValueError):
    """An instance of a sharded run could not be loaded on some rank; raised on every rank of the group before
    any bound is computed, so the ranks can report it and go on to the next instance together."""


class _Run:
    """Bookkeeping of one ``verify`` call: phase timing, and the instance's budget (its deadline)."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.times: dict[str, float] = {}

    def timed(self, phase: str, fn, *args, **kwargs):
        start = time.monotonic()
        try:
            with syncs.phase(phase):
                return fn(*args, **kwargs)
        finally:
            self.times[phase] = self.times.get(phase, 0.0) + time.monotonic() - start

    @property
    def expired(self) -> bool:
        """Whether the budget ran out (on any rank of a sharded run: they all stop together)."""
        return self.budget.expired


def _counterexample(graph: BoundGraph, x: torch.Tensor) -> Counterexample:
    with torch.no_grad():
        y = graph(x.unsqueeze(0))[0]
    return Counterexample(x.double().flatten().cpu().numpy(), y.double().flatten().cpu().numpy())


def _ibp_margins(graph: BoundGraph, spec: OutputSpec, box: Interval) -> torch.Tensor:
    """Interval propagation's margins ``[S]``; the outputs' bounds also charge the rounding of the spec's
    coefficients (:meth:`OutputSpec.bound_outputs`)."""
    out = graph.ibp(box)[graph.output.name]
    spec.bound_outputs(out)
    lower, upper = flat(out.lower, 1).double(), flat(out.upper, 1).double()
    matrix = spec.matrix.double()
    # Exact products of float32 numbers, summed in float64: relative error ≤ outputs·2⁻⁵³ of the terms' magnitudes.
    terms = lower @ matrix.clamp(min=0).T + upper @ matrix.clamp(max=0).T
    magnitude = torch.maximum(lower.abs(), upper.abs()) @ matrix.abs().T
    slack = (matrix.shape[1] + 1) * FLOAT64_EPSILON * magnitude
    return spec.margins(round_down((terms - slack).T, out.lower.dtype))[0]


@dataclass
class _CaseAnswer:
    """The outcome for one case: verdict, counterexample input, deciding method, root margins, which
    branch-and-bound ran and its statistics."""

    verdict: Verdict
    counterexample: torch.Tensor | None = None
    decided_by: str | None = None
    margins: list[float] = field(default_factory=list)
    bab_mode: BabMode | None = None
    domains_bounded: int = 0
    max_depth: int = 0
    refine: RefineStats | None = None


def _free_dims(box: Interval) -> int:
    return int(free_coordinates(box).sum())


#: The most spec-row margins the first attack's steps compute (restarts × rows, 16 MiB in float32): a property of
#: thousands of disjuncts gets fewer restarts, so that one step stays short enough to stop at the deadline (10,000
#: restarts on 4,096 disjuncts of 12 rows took 47 s of a 5 s timeout).
ATTACK_MARGINS = 1 << 22
#: Boxes of at most this many free dimensions get 10,000 random starts, which then cover them (ACAS Xu 2_9/φ8 is
#: found among them); in more dimensions random starts cover nothing and 50 do as well.
_DENSE_ATTACK_DIMS = 20


def _attack_restarts(config: VerifyConfig, box: Interval, spec: OutputSpec) -> int:
    if config.attack_restarts is not None:
        return config.attack_restarts
    restarts = 10_000 if _free_dims(box) <= _DENSE_ATTACK_DIMS else 50
    return max(1, min(restarts, ATTACK_MARGINS // max(spec.num_rows, 1)))


def _refinement(config: VerifyConfig, graph: BoundGraph, plan: ShardPlan) -> Refine:
    """``config.refine`` with ``auto`` resolved; ``none`` where programs cannot be written (other operators, or
    weights sharded over ranks)."""
    if plan.sharded or config.refine is Refine.NONE:
        return Refine.NONE
    try:
        require_extra("highspy", "lp", f"refine={config.refine.value!r} (LP/MILP bound refinement by HiGHS)")
    except ImportError as err:
        if config.refine is not Refine.AUTO:
            raise
        warnings.warn(f"Verifying without LP/MILP bound refinement: {err}", RuntimeWarning, stacklevel=2)
        return Refine.NONE
    from lightning_fedshard.verify.bounds.lp import supports_programs

    if not supports_programs(graph):
        return Refine.NONE
    if config.refine is not Refine.AUTO:
        return config.refine
    return Refine.MILP if len(graph.relus) >= 3 else Refine.NONE


def _refine(
    graph: BoundGraph, box: Interval, root: AlphaResult, how: Refine, config: VerifyConfig, run: _Run
) -> tuple[dict[str, Interval], RefineStats]:
    """LP/MILP-tightened bounds of every pre-activation that interval propagation does not give exactly, the
    neurons with the widest triangles first, within the refinement budget."""
    from lightning_fedshard.verify.bounds.lp import refine_bounds

    layers = [pre for pre in graph.pre_activation.values() if not graph.ibp_is_exact(pre)]
    gap = {}
    for pre in layers:
        l, u = root.bounds[pre].lower, root.bounds[pre].upper
        gap[pre] = -l * u / (u - l).clamp(min=1e-12)  # the triangle's height above the ReLU
    with run.budget.within(config.refine_budget * config.timeout):
        return refine_bounds(
            graph,
            box,
            root.bounds,
            layers,
            integer="all" if how is Refine.MILP else "none",
            time_limit=config.refine_solve_limit,
            workers=config.refine_workers,
            order=gap,
            layer_budget=config.refine_layer_share * config.refine_budget * config.timeout,
        )


def _bab_mode(config: VerifyConfig, graph: BoundGraph, box: Interval, unstable: int) -> BabMode:
    """``config.bab``, with ``auto`` resolved: the input box when it has few free dimensions and either the root
    leaves more neurons to split than that (unstable ReLUs, the inputs of other non-linear ops: splitting them would
    take more splits than splitting the box) or the graph has smooth operators (whose splits only narrow their
    relaxations, where a smaller box tightens all of them at once)."""
    if config.bab is not BabMode.AUTO:
        return config.bab
    free = _free_dims(box)
    few = free <= config.input_split_max_dims
    return BabMode.INPUT if few and (unstable > free or not graph.exact_when_split) else BabMode.NEURON


def _verify_case(
    graph: BoundGraph, case: Case, config: VerifyConfig, plan: ShardPlan, run: _Run, generator: torch.Generator
) -> _CaseAnswer:
    box = box_tensor(
        case.box.lower, case.box.upper, graph.input.shape, graph.dtype, graph.device, graph.input_precision
    )
    if any(len(d.rhs) == 0 for d in case.disjuncts):  # an unconstrained disjunct: every output is unsafe
        return _CaseAnswer(Verdict.SAT, box.center[0], "pgd")
    spec = OutputSpec.from_case(case, graph.output.shape, graph.dtype, graph.device)
    with torch.no_grad(), run.budget.within(config.attack_budget * config.timeout):
        x = run.timed(
            "attack",
            pgd_attack,
            graph,
            spec,
            box,
            _attack_restarts(config, box, spec),
            config.attack_steps,
            generator=generator,
        )
    if x is not None:
        return _CaseAnswer(Verdict.SAT, x, "pgd")

    def proven(margins: torch.Tensor) -> bool:
        return bool(spec.value(margins.view(1, -1)) > 0)

    def undecided(margins: torch.Tensor, refine: RefineStats | None = None) -> _CaseAnswer:
        verdict = Verdict.TIMEOUT if run.expired else Verdict.UNKNOWN
        return _CaseAnswer(verdict, None, None, margins.tolist(), refine=refine)

    with torch.no_grad():
        margins = run.timed("ibp", _ibp_margins, graph, spec, box)
    if proven(margins):
        return _CaseAnswer(Verdict.UNSAT, None, "ibp", margins.tolist())
    if config.method is Method.IBP:
        return undecided(margins)

    partition = plan.partition

    def crown() -> tuple[torch.Tensor, dict[str, Interval]]:
        bounds = intermediate_bounds(graph, box, intersect_ibp=config.intersect_ibp, partition=partition)
        lower = spec_lower(graph, spec.rows(1), box, bounds, partition=partition)
        return spec.margins(lower)[0], bounds

    with torch.no_grad():
        margins, root_bounds = run.timed("crown", crown)
    if proven(margins):
        return _CaseAnswer(Verdict.UNSAT, None, "crown", margins.tolist())
    # Without a relaxation (an affine graph, roundings apart) CROWN's bound is the exact minimum up to rounding: no
    # split can tighten it, and the attack has had its chance.
    if config.method is Method.CROWN or run.expired or not graph.nonlinear:
        return undecided(margins)

    bab_mode = _bab_mode(config, graph, box, int(open_neurons(graph, root_bounds).sum()))

    def alpha(reference: dict[str, Interval] | None = None) -> AlphaResult:
        return run.timed(
            "alpha-crown",
            alpha_crown,
            graph,
            box,
            spec.rows(1),
            config.alpha_iterations,
            config.alpha_lr,
            config.alpha_lr_decay,
            stop_above=spec.threshold.view(-1, 1),
            intersect_ibp=config.intersect_ibp,
            partition=partition,
            reference=reference,
        )

    root, refine_stats = None, None
    if bab_mode is BabMode.NEURON or config.method is Method.ALPHA_CROWN:
        # Input splitting bounds small boxes with plain CROWN; only ReLU splitting starts from α-CROWN's slopes.
        root = alpha()
        margins = spec.margins(root.lower)[0]
        if proven(margins):
            return _CaseAnswer(Verdict.UNSAT, None, "alpha-crown", margins.tolist())
    if config.method is Method.ALPHA_CROWN or run.expired:
        return undecided(margins)
    how = _refinement(config, graph, plan) if bab_mode is BabMode.NEURON else Refine.NONE
    if how is not Refine.NONE:
        refined, refine_stats = run.timed("refine", _refine, graph, box, root, how, config, run)
        root = alpha(refined)
        margins = spec.margins(root.lower)[0]
        if proven(margins):
            return _CaseAnswer(Verdict.UNSAT, None, how.value, margins.tolist(), refine=refine_stats)
        if run.expired:
            return undecided(margins, refine_stats)

    # Each disjunct not ruled out at the root gets its own search (α,β-CROWN does the same per target label): the
    # branching then serves one objective, and the rows already proven cost nothing more.
    open_disjuncts = [d for d in range(spec.num_disjuncts) if not float(margins[spec.rows_of(d)].max()) > 0]
    open_disjuncts.sort(key=lambda d: float(margins[spec.rows_of(d)].max()))
    answer = _CaseAnswer(Verdict.UNSAT, None, "bab", margins.tolist(), bab_mode, refine=refine_stats)
    for d in open_disjuncts:
        if bab_mode is BabMode.INPUT:
            outcome = run.timed(
                "bab",
                input_split,
                graph,
                spec.only(d),
                box,
                config,
                generator,
                RootBounds(root_bounds, run.times["crown"]),
            )
        else:
            with plan.domain_search(graph):
                outcome = run.timed(
                    "bab",
                    branch_and_bound,
                    graph,
                    spec.only(d),
                    box,
                    root.rows(spec.rows_of(d)),
                    config,
                    generator,
                    plan.domain_group,
                )
        answer.domains_bounded += outcome.domains_bounded
        answer.max_depth = max(answer.max_depth, outcome.max_depth)
        if outcome.verdict in (Verdict.SAT, Verdict.TIMEOUT):
            answer.verdict = outcome.verdict
            answer.counterexample = outcome.counterexample
            break
        if outcome.verdict is Verdict.UNKNOWN:
            answer.verdict = Verdict.UNKNOWN  # keep searching the other disjuncts for a counterexample
    if answer.verdict not in (Verdict.SAT, Verdict.UNSAT):
        answer.decided_by = None
    return answer


def verify(
    graph: BoundGraph,
    prop: Property,
    config: VerifyConfig | None = None,
    plan: ShardPlan | None = None,
    budget: Budget | None = None,
) -> VerificationResult:
    """Decide ``prop`` on ``graph``: ``sat`` if some case has a counterexample, ``unsat`` if every case is
    proven, else ``unknown`` (or ``timeout`` when the budget ran out).

    ``budget`` is the instance's deadline and memory (made from ``config`` now if not given:
    :meth:`Budget.from_config`); a pass that cannot fit the memory even in its smallest chunks ends the run with
    ``unknown``, the reason saying what it needed.

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
    budget = budget or Budget.from_config(config, graph.device)
    with lockstep(plan.lockstep_group):
        # Sharded, every rank sizes its passes from the same budget (the least; their free memory may differ),
        # so that they decide alike which passes run whole.
        budget.memory = agree_least(budget.memory)
    run = _Run(budget)
    generator = torch.Generator().manual_seed(config.seed)
    result = VerificationResult(Verdict.UNSAT)
    meter = PeakMemoryMeter(graph.device, tensor_bytes(graph.constants())) if config.measure_memory else None
    with full_precision(), lockstep(plan.lockstep_group), budget.using(), meter or nullcontext():
        if meter is not None:
            meter.mark_baseline()
        try:
            for case in prop.cases:
                if _decide_case(graph, case, config, plan, run, generator, result):
                    break
        except DeadlineExceeded:  # inside a bound pass, on every rank of a sharded run at once
            result.verdict = Verdict.TIMEOUT
        except MemoryBudgetExceeded as exceeded:  # before it allocated: the same sizes on every rank
            result.verdict, result.reason = Verdict.UNKNOWN, str(exceeded)
    if result.verdict is not Verdict.UNSAT and result.verdict is not Verdict.SAT:
        result.decided_by = None
    result.times = run.times
    if meter is not None:
        result.baseline_memory_bytes, result.peak_memory_bytes = meter.baseline_bytes, meter.peak_bytes
    result.rss_peak_bytes = peak_resident_bytes()
    result.memory_budget_bytes = budget.memory
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
    answer = _verify_case(graph, case, config, plan, run, generator)
    result.root_margins.append(answer.margins)
    result.domains_bounded += answer.domains_bounded
    result.max_depth = max(result.max_depth, answer.max_depth)
    if answer.bab_mode is not None and answer.bab_mode.value not in result.bab_modes:
        result.bab_modes.append(answer.bab_mode.value)
    if answer.refine is not None:
        for key in ("solves", "tightened", "stabilised", "seconds"):
            result.refinement[key] = result.refinement.get(key, 0) + getattr(answer.refine, key)
    if answer.verdict is Verdict.SAT:
        result.verdict, result.decided_by = Verdict.SAT, answer.decided_by
        result.counterexample = _counterexample(graph, answer.counterexample)
        return True
    if answer.verdict is not Verdict.UNSAT:
        # Keep looking for a counterexample in the other cases; the answer can no longer be unsat.
        result.verdict = answer.verdict if result.verdict is Verdict.UNSAT else result.verdict
    elif result.verdict is Verdict.UNSAT:
        result.decided_by = answer.decided_by
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
    ``unknown``, the reason kept in ``counterexample_check``. A model the verifier cannot represent
    (:class:`~lightning_fedshard.verify.onnx.UnsupportedModelError`), a property whose output constraints
    multiply out too far (:class:`~lightning_fedshard.verify.spec.UnsupportedPropertyError`), and in a
    one-process run any error while bounding, answer ``unknown`` with the ``reason``; the deadline passing while
    the property is expanded answers ``timeout``. Files that cannot be read at all raise.

    Sharded (``plan``), every rank of the group calls it with the same files; the model is sharded right after
    loading, and a file that fails to load on any rank raises :class:`InstanceLoadError` on all of them before
    any bound is computed. Any later error is this rank's alone: it must end the run (the other ranks' next
    collective then fails), never be caught and skipped, or the ranks' collectives would no longer match.
    """
    config, plan = config or VerifyConfig(), plan or ShardPlan()
    # auto picks its device by the net's size: the model is loaded on the CPU first (every rank of a sharded run
    # loads the same one, so they all pick the same device type)
    auto = config.device == "auto"
    start, device = time.monotonic(), torch.device("cpu") if auto else resolve_device(config.device)
    budget = Budget.from_config(config, device)
    try:
        graph, prop = _load_everywhere(onnx_path, vnnlib_path, plan, budget, device)
    except _AnsweredAtLoad as answer:
        return VerificationResult(answer.verdict, times={"load": time.monotonic() - start}, reason=answer.reason)
    if auto and (device := resolve_device("auto", graph=graph)).type != "cpu":
        budget = dataclasses.replace(Budget.from_config(config, device), deadline=budget.deadline)
        graph = graph.to(device=device)
    forward = model_forward(onnx_path, graph)
    sharded = plan.shard(graph)
    sharded.model = forward  # counterexamples count once the model itself confirms them
    if sharded is not graph:
        graph = None  # this rank keeps its shards only
    load_time = time.monotonic() - start
    try:
        result = verify(sharded, prop, config, plan, budget)
    except Exception as error:
        if plan.sharded:
            raise  # the other ranks wait in a collective: end the run (see above)
        # One process: a bug must not cost the answer file; the instance is unknown, and the reason says why.
        if _allocation_failed(error):
            reason = f"out of memory ({error}); memory budget {budget.memory / 2**30:.1f} GiB"
        else:
            logging.getLogger(__name__).exception("verifying %s against %s failed", onnx_path, vnnlib_path)
            reason = f"internal error: {type(error).__name__}: {error}"
        result = VerificationResult(Verdict.UNKNOWN, reason=reason, memory_budget_bytes=budget.memory)
    result.times = {"load": load_time, **result.times}
    if result.verdict is Verdict.SAT:
        # The outputs a counterexample claims are the ONNX model's own (the scorer replays on onnxruntime, which sums
        # in another order than our float32 graph), and the property is judged on those outputs.
        x = result.counterexample.x
        result.counterexample = Counterexample(x, forward(x))
        check = check_counterexample(result.counterexample, prop, forward)
        result.counterexample_check = check.reason
        # Our graph computing something else than the model would be a loader bug: the model's outputs must lie in
        # the graph's interval bounds at the point, which contain every rounding the model may do.
        if check.ok and graph is not None and not _encloses(graph, x, result.counterexample.y):
            result.counterexample_check = "onnxruntime's outputs at the counterexample lie outside our bounds there"
        if result.counterexample_check != "ok":
            result.verdict, result.decided_by, result.counterexample = Verdict.UNKNOWN, None, None
    return result


def prepare_files(onnx_path: str | Path, vnnlib_path: str | Path, device: str = "cpu") -> str:
    """Load an instance without verifying it, as VNN-COMP's ``prepare_instance.sh`` runs before the clock starts:
    the model and the property are read as :func:`verify_files` reads them, and one forward pass at the centre of
    the first input box runs on our graph and on the model that replays counterexamples, so that the timed run
    finds the libraries, the files and the device warm. Nothing is bounded. Returns a one-line summary.

    Raises :class:`~lightning_fedshard.verify.onnx.UnsupportedModelError` or
    :class:`~lightning_fedshard.verify.spec.UnsupportedPropertyError` for an instance the verifier would answer
    ``unknown`` at once, and ``OSError``/``ValueError`` for files that cannot be read.

    Example::

        prepare_files("net.onnx", "prop.vnnlib")  # '5 inputs, 5 outputs, 1 input box(es), 1 unsafe set(s)'
    """
    graph = load_onnx(onnx_path, device="cpu" if device == "auto" else resolve_device(device))
    graph = graph.to(device=resolve_device(device, graph=graph)) if device == "auto" else graph
    prop = read_vnnlib(vnnlib_path, graph.input.size, graph.output.size)
    box = prop.cases[0].box
    centre = (box.lower + box.upper) / 2
    with torch.no_grad():
        graph(torch.as_tensor(centre, dtype=graph.dtype, device=graph.device).view(1, -1))
    model_forward(onnx_path, graph)(centre)
    disjuncts = sum(len(case.disjuncts) for case in prop.cases)
    return (
        f"{prop.num_inputs} inputs, {prop.num_outputs} outputs, {len(prop.cases)} input box(es), "
        f"{disjuncts} unsafe set(s)"
    )


def _allocation_failed(error: BaseException) -> bool:
    """Whether ``error`` is an allocator's refusal (a pass the budget's estimates let through, on a machine whose
    memory others took meanwhile): an answer's reason, not a bug."""
    return isinstance(error, torch.OutOfMemoryError | MemoryError) or "can't allocate memory" in str(error)


def _encloses(graph: BoundGraph, x: np.ndarray, y: np.ndarray) -> bool:
    """Whether the model's outputs ``y`` at the point ``x`` lie in the graph's interval bounds over that point."""
    box = box_tensor(x, x, graph.input.shape, graph.dtype, graph.device, graph.input_precision)
    with torch.no_grad(), full_precision():
        out = graph.ibp(box)[graph.output.name]
    lower, upper = (flat(bound, 1)[0].double().cpu().numpy() for bound in (out.lower, out.upper))
    return bool(np.all((lower <= y) & (y <= upper)))


class _AnsweredAtLoad(Exception):
    """Loading decided the answer before any bound: ``unknown`` for a model or property the verifier does not
    take on, ``timeout`` when the deadline passed while the property was expanded."""

    def __init__(self, verdict: Verdict, reason: str) -> None:
        super().__init__(reason)
        self.verdict, self.reason = verdict, reason


def _load_everywhere(
    onnx_path: str | Path, vnnlib_path: str | Path, plan: ShardPlan, budget: Budget, device: torch.device
) -> tuple[BoundGraph, Property]:
    """The model and the property, or :class:`_AnsweredAtLoad`; sharded, every rank of the group ends the same
    way: :class:`InstanceLoadError` if any rank failed, else the answer of any rank that reached one (a
    ``timeout`` first: the ranks' clocks differ, their files do not)."""
    error: Exception | None = None
    outcome: tuple[str, str] | None = None  # (verdict or "error", reason or "Type: message")
    try:
        graph = load_onnx(onnx_path, device=device)
        prop = read_vnnlib(vnnlib_path, graph.input.size, graph.output.size, budget.deadline)
    except (UnsupportedModelError, UnsupportedPropertyError) as exc:
        outcome = (Verdict.UNKNOWN.value, str(exc))
    except TimeoutError as exc:
        outcome = (Verdict.TIMEOUT.value, str(exc))
    except Exception as exc:  # noqa: BLE001 (re-raised below, on every rank of a sharded run)
        error, outcome = exc, (Verdict.ERROR.value, f"{type(exc).__name__}: {exc}")
    if plan.sharded:
        outcomes: list[tuple[str, str] | None] = [None] * dist.get_world_size(plan.group)
        dist.all_gather_object(outcomes, outcome, plan.group)
        first: dict[str, tuple[int, str]] = {}  # how a rank's loading ended -> the first rank that ended so
        for rank, theirs in enumerate(outcomes):
            if theirs is not None:
                first.setdefault(theirs[0], (rank, theirs[1]))
        if Verdict.ERROR.value in first:
            rank, message = first[Verdict.ERROR.value]
            raise InstanceLoadError(f"rank {rank} of the sharded group could not load the instance: {message}")
        for verdict in (Verdict.TIMEOUT, Verdict.UNKNOWN):
            if verdict.value in first:
                raise _AnsweredAtLoad(verdict, first[verdict.value][1])
    if error is not None:
        raise error
    if outcome is not None:
        raise _AnsweredAtLoad(Verdict(outcome[0]), outcome[1])
    return graph, prop


def model_forward(onnx_path: str | Path, graph: BoundGraph | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """Flat-input forward pass on the ONNX model for confirming and replaying counterexamples: onnxruntime where
    installed (independent of our loader; its session made on the first call, most runs never need one), else the
    loaded graph."""
    try:
        import onnxruntime
    except ImportError:
        graph = graph if graph is not None else load_onnx(onnx_path)

        def run_graph(x: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                x = torch.as_tensor(x, dtype=graph.dtype, device=graph.device).view(1, -1)
                return graph(x).double().cpu().numpy().ravel()

        return run_graph

    @functools.cache
    def session() -> tuple[onnxruntime.InferenceSession, str, list[int], type]:
        made = onnxruntime.InferenceSession(onnx_source(onnx_path), providers=["CPUExecutionProvider"])
        (inp,) = made.get_inputs()
        shape = [1 if not isinstance(d, int) else d for d in inp.shape]
        return made, inp.name, shape, _ONNXRUNTIME_TYPES.get(inp.type, np.float32)  # float64, float16 models too

    def run_session(x: np.ndarray) -> np.ndarray:
        made, name, shape, dtype = session()
        return made.run(None, {name: np.asarray(x, dtype=dtype).reshape(shape)})[0].astype(np.float64).ravel()

    return run_session


#: onnxruntime's names of the input types a counterexample is replayed in.
_ONNXRUNTIME_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16}
