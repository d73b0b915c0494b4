"""What a verification run may do, and what it can answer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from lightning_fedshard.verify.device import check_device

__all__ = ["BabMode", "InputBranching", "Method", "Refine", "Verdict", "VerifyConfig", "check_timeout"]


class Method(str, Enum):
    """The strongest bounding method a run may use; each one runs the cheaper ones first."""

    IBP = "ibp"
    CROWN = "crown"
    ALPHA_CROWN = "alpha-crown"
    BETA_CROWN = "beta-crown"  # α-CROWN at the root, then branch-and-bound with β-CROWN


class BabMode(str, Enum):
    """What branch-and-bound splits: neurons (``neuron``: ReLU phases, and the inputs of the other non-linear ops
    at chosen points; ``relu`` is accepted for it), the input box (``input``), or ``auto``: the input box when it
    has at most :attr:`VerifyConfig.input_split_max_dims` dimensions of non-zero width and the root bounds leave
    more neurons to split than that or the graph has smooth operators, else neurons."""

    AUTO = "auto"
    NEURON = "neuron"
    INPUT = "input"

    @classmethod
    def _missing_(cls, value):
        return cls.NEURON if value == "relu" else None


class InputBranching(str, Enum):
    """How an input-splitting search picks the dimensions to bisect.

    ``sb``: α,β-CROWN's *sb* score ``max_s max(|lA_si|, 10⁻³)·(x_U,i − x_L,i)/2 + margin_s``, the gain of the
    linear bound from halving dimension ``i``, most promising row first. ``trial``: brute force on cheap bounds:
    both halves of every dimension are bounded in forward mode and the dimension whose halves come out best
    (the sum of their shortfalls below zero) is split; this also sees the relaxations tighten, which *sb* does not.
    """

    SB = "sb"
    TRIAL = "trial"


class Refine(str, Enum):
    """How the intermediate bounds are tightened before ReLU branch-and-bound (α,β-CROWN's *bab-refine*): not at
    all, by an LP over the triangle relaxation, or by a MILP with binary ReLU phases (HiGHS). ``auto``: MILP for
    fully connected ReLU networks with at least three ReLU layers (where α-CROWN's bounds leave branch-and-bound
    too much to do), else none; never in sharded runs."""

    NONE = "none"
    LP = "lp"
    MILP = "milp"
    AUTO = "auto"


class Verdict(str, Enum):
    """The answer for an instance: the VNN-COMP result words (``sat`` = a counterexample exists, one is given;
    ``unsat`` = proven safe; ``unknown``; ``timeout``), or ``error``: the instance could not be verified at all (a
    file that cannot be read, ranks that disagree), which no result file holds."""

    SAT = "sat"
    UNSAT = "unsat"
    UNKNOWN = "unknown"
    TIMEOUT = "timeout"
    ERROR = "error"


def check_timeout(seconds: float) -> float:
    """``seconds`` if it is a timeout a run can keep: positive and finite (NaN, which compares false with every
    deadline, would mean none at all). Raises ``ValueError`` otherwise.

    >>> check_timeout(120.0)
    120.0
    """
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"a timeout must be a positive, finite number of seconds, got {seconds!r}")
    return seconds


@dataclass(frozen=True)
class VerifyConfig:
    """Settings of one verification run.

    Example::

        config = VerifyConfig(method=Method.BETA_CROWN, timeout=120, batch_size=256)
    """

    method: Method = Method.BETA_CROWN
    #: Wall-clock budget in seconds for the whole instance (loading excluded); the answer is then ``timeout``.
    timeout: float = 120.0
    #: PGD before bounding: restarts (restart 0 is the box centre; ``None``: 10,000 for boxes with at most 20
    #: free dimensions, where random starts cover the box, else 50) and steps per
    #: restart, stopped after ``attack_budget`` of the timeout (more attacks run inside branch-and-bound).
    attack_restarts: int | None = None
    attack_steps: int = 100
    attack_budget: float = 0.1
    #: α-CROWN at the root: iterations, Adam learning rate, per-iteration decay.
    alpha_iterations: int = 40
    alpha_lr: float = 0.1
    alpha_lr_decay: float = 0.98
    #: Branch-and-bound: domains bounded per batch, β-CROWN iterations per batch and learning rates.
    batch_size: int = 256
    beta_iterations: int = 20
    beta_lr_alpha: float = 0.01
    beta_lr_beta: float = 0.05
    #: Branching: 1 = BaBSR alone; k > 1 = FSB over the top-k BaBSR candidates.
    branching_candidates: int = 3
    #: What branch-and-bound splits (see :class:`BabMode`).
    bab: BabMode = BabMode.AUTO
    #: LP/MILP refinement of the intermediate bounds before ReLU branch-and-bound (see :class:`Refine`): at most
    #: ``refine_budget`` of the timeout, of which one layer may take ``refine_layer_share``, each solve capped at
    #: ``refine_solve_limit`` seconds, spread over ``refine_workers`` processes (one run per core: 1).
    refine: Refine = Refine.AUTO
    refine_budget: float = 0.5
    refine_layer_share: float = 1.0
    refine_solve_limit: float = 2.0
    refine_workers: int = 1
    #: ``auto`` splits the input of networks with at most this many (non-degenerate) input dimensions.
    input_split_max_dims: int = 40
    #: Input splitting: boxes bounded per round (small batches keep the union of unstable neurons, whose rows
    #: every box pays for, small), and beyond how many open boxes to give up (``unknown``).
    input_batch_size: int = 128
    max_input_domains: int = 5_000_000
    #: GiB of working memory the instance may hold on top of what the process held before it (the interpreter):
    #: every pass that grows with the net sizes its chunks to fit (:class:`~lightning_fedshard.verify.budget.Budget`).
    #: ``None``: ``memory_fraction`` of the memory free when the instance starts (``MemAvailable`` and the cgroup's
    #: limit on the CPU, ``torch.cuda.mem_get_info`` on CUDA), so that processes side by side each keep theirs.
    memory: float | None = None
    memory_fraction: float = 0.4
    #: Input splitting: one search per branching rule, run side by side (see :class:`InputBranching`).
    input_branching: tuple[InputBranching, ...] = (InputBranching.SB, InputBranching.TRIAL)
    #: Every this many batches, PGD from the minimising corners of the worst domains (0 = never).
    attack_every: int = 10
    #: Stop branching (answer ``unknown``) beyond this many open domains, to bound memory.
    max_domains: int = 200_000
    #: Intersect CROWN's intermediate bounds with interval bounds (tighter; off reproduces auto_LiRPA).
    intersect_ibp: bool = True
    #: Count live tensor memory during the run: exact on CPU, but ~5 µs per op (2.3× the time of a small-net
    #: search), so off unless asked for; on CUDA the allocator's statistics, at no cost.
    measure_memory: bool = False
    seed: int = 0
    #: Where the model, boxes, bounds, branch-and-bound domains and attacks live: ``cpu``, ``cuda`` (each rank
    #: of a sharded run on GPU ``LOCAL_RANK % device_count``), ``cuda:N``, or ``auto`` (``cuda`` where available
    #: and one bound pass of the net is big enough for a GPU to win:
    #: :data:`~lightning_fedshard.verify.device.AUTO_CUDA_FLOPS`).
    #: LP/MILP refinement solves on the CPU (HiGHS) whatever the device. Checked at construction: ``cuda``
    #: without CUDA is a ``ValueError`` before anything runs.
    device: str = "cpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method(self.method))
        object.__setattr__(self, "bab", BabMode(self.bab))
        object.__setattr__(self, "refine", Refine(self.refine))
        object.__setattr__(self, "input_branching", tuple(InputBranching(b) for b in self.input_branching))
        if not self.input_branching:
            raise ValueError("VerifyConfig.input_branching needs at least one rule")
        check_timeout(self.timeout)
        if self.memory is not None and not (math.isfinite(self.memory) and self.memory > 0):
            raise ValueError(f"VerifyConfig.memory must be positive and finite GiB (or None), got {self.memory}")
        if self.memory_fraction > 1:
            raise ValueError(f"VerifyConfig.memory_fraction must be at most 1, got {self.memory_fraction}")
        check_device(self.device)
        for name in (
            "alpha_lr",
            "beta_lr_alpha",
            "beta_lr_beta",
            "attack_budget",
            "refine_budget",
            "refine_layer_share",
            "refine_solve_limit",
            "memory_fraction",
        ):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):  # NaN compares false
                raise ValueError(f"VerifyConfig.{name} must be positive and finite, got {getattr(self, name)}")
        for name in ("attack_restarts", "attack_steps", "alpha_iterations", "beta_iterations", "attack_every"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"VerifyConfig.{name} must be ≥ 0, got {getattr(self, name)}")
        for name in (
            "batch_size",
            "branching_candidates",
            "max_domains",
            "input_split_max_dims",
            "input_batch_size",
            "max_input_domains",
            "refine_workers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"VerifyConfig.{name} must be ≥ 1, got {getattr(self, name)}")
