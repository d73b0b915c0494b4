"""The outcome of verifying one instance: one type from the verifier to the command line, whichever way the
instance ran (a call of :func:`~lightning_fedshard.verify.verifier.verify`, a benchmark folder, the Lightning
predict loop on many ranks), and the JSON report written from it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from lightning_fedshard.verify.config import Verdict
from lightning_fedshard.verify.spec import Counterexample

__all__ = ["RankReport", "VerificationResult"]


@dataclass
class RankReport:
    """What one rank of a run reports for itself: its place in the mesh (global rank, data-parallel and
    tensor-parallel rank), its own answer, its wall time (seconds, loading included) and its memory.

    Example::

        [(r.rank, r.verdict.value, r.peak_memory_bytes) for r in result.per_rank]
    """

    rank: int
    dp_rank: int
    tp_rank: int
    verdict: Verdict
    decided_by: str | None
    error: str
    root_margins: list[list[float]]
    time_s: float
    baseline_memory_bytes: int
    peak_memory_bytes: int
    rss_peak_bytes: int

    @classmethod
    def of(cls, result: VerificationResult, rank: int = 0, dp_rank: int = 0, tp_rank: int = 0) -> RankReport:
        """This rank's share of ``result``, the answer it computed."""
        return cls(
            rank,
            dp_rank,
            tp_rank,
            result.verdict,
            result.decided_by,
            result.error,
            result.root_margins,
            result.time_s,
            result.baseline_memory_bytes,
            result.peak_memory_bytes,
            result.rss_peak_bytes,
        )

    def to_report(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"verdict": self.verdict.value}


@dataclass
class VerificationResult:
    """The answer for one instance.

    ``verdict``: :class:`~lightning_fedshard.verify.config.Verdict`; ``error`` says why for ``error`` (an instance
    that could not be verified at all: ``"Type: message"``), ``reason`` why an ``unknown`` was not even tried.
    ``root_margins[c][r]``: lower bound of spec row ``r`` of case ``c`` by the strongest root method run
    (``M y − b``; positive rules its disjunct out). ``decided_by``: ``"pgd"``, ``"ibp"``, ``"crown"``,
    ``"alpha-crown"``, ``"lp"``, ``"milp"``, ``"bab"`` (or ``None``); ``times``: seconds per phase. Memory of this
    rank (see :class:`~lightning_fedshard.verify.memory.PeakMemoryMeter`): ``baseline_memory_bytes`` before
    propagation (the constants it holds: full weights, or its shards) and ``peak_memory_bytes`` during it (both 0
    unless ``config.measure_memory``); ``rss_peak_bytes`` is the process's resident high-water mark since it
    started, ``memory_budget_bytes`` the working memory the instance's passes were sized to
    (:class:`~lightning_fedshard.verify.budget.Budget`).

    An instance run from its files (:func:`~lightning_fedshard.verify.instances.run_instance`, the predict loop)
    also has ``onnx``, ``vnnlib``, its ``index`` in the run and ``time_s``, the wall time with loading (the
    slowest rank's, of a sharded run); a result from the predict loop has ``per_rank``, every rank's own
    :class:`RankReport`, which a group of ranks agreeing on one answer merges into one result.

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
    memory_budget_bytes: int = 0
    domains_bounded: int = 0
    max_depth: int = 0
    #: Which branch-and-bound ran (``"neuron"``, ``"input"``; one entry per kind, in the order the cases used them).
    bab_modes: list[str] = field(default_factory=list)
    #: LP/MILP refinement, summed over the cases that ran it: solves, bounds tightened, neurons made stable, seconds.
    refinement: dict[str, float] = field(default_factory=dict)
    #: For a ``sat`` from :func:`verify_files`: ``"ok"`` once the counterexample replayed on the ONNX model.
    counterexample_check: str = ""
    #: Why an instance was answered ``unknown`` (or ``timeout``) without being tried (a model the verifier cannot
    #: represent, an internal error, a property too large to expand), else empty.
    reason: str = ""
    error: str = ""
    onnx: str = ""
    vnnlib: str = ""
    index: int = 0
    time_s: float = 0.0
    per_rank: list[RankReport] = field(default_factory=list)

    @classmethod
    def failed(cls, error: BaseException | str) -> VerificationResult:
        """The ``error`` result of an instance that could not be verified: ``"Type: message"`` of ``error``."""
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        return cls(Verdict.ERROR, error=message)

    def to_report(self) -> dict:
        """The JSON-able report ``fedshard verify --report`` writes (everything but the counterexample, which the
        result file holds)."""
        return {
            "verdict": self.verdict.value,
            "decided_by": self.decided_by,
            "root_margins": self.root_margins,
            "times_s": self.times,
            "total_time_s": sum(self.times.values()),
            "baseline_memory_bytes": self.baseline_memory_bytes,
            "peak_memory_bytes": self.peak_memory_bytes,
            "rss_peak_bytes": self.rss_peak_bytes,
            "memory_budget_bytes": self.memory_budget_bytes,
            "domains_bounded": self.domains_bounded,
            "max_depth": self.max_depth,
            "bab_modes": self.bab_modes,
            "refinement": self.refinement,
            **({"counterexample_check": self.counterexample_check} if self.counterexample_check else {}),
            **({"reason": self.reason} if self.reason else {}),
            **({"error": self.error} if self.error else {}),
            **({"per_rank": [rank.to_report() for rank in self.per_rank]} if self.per_rank else {}),
        }
