"""What a verification run may do, and what it can answer."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Method", "Verdict", "VerifyConfig"]


class Method(str, Enum):
    """The strongest bounding method a run may use; each one runs the cheaper ones first."""

    IBP = "ibp"
    CROWN = "crown"
    ALPHA_CROWN = "alpha-crown"
    BETA_CROWN = "beta-crown"  # α-CROWN at the root, then branch-and-bound with β-CROWN


class Verdict(str, Enum):
    """VNN-COMP result words: ``sat`` = a counterexample exists (one is given), ``unsat`` = proven safe."""

    SAT = "sat"
    UNSAT = "unsat"
    UNKNOWN = "unknown"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class VerifyConfig:
    """Settings of one verification run.

    Example::

        config = VerifyConfig(method=Method.BETA_CROWN, timeout=120, batch_size=256)
    """

    method: Method = Method.BETA_CROWN
    #: Wall-clock budget in seconds for the whole instance (loading excluded); the answer is then ``timeout``.
    timeout: float = 120.0
    #: PGD before bounding: restarts (restart 0 is the box centre) and steps per restart.
    attack_restarts: int = 50
    attack_steps: int = 100
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method(self.method))
        for name in ("timeout", "alpha_lr", "beta_lr_alpha", "beta_lr_beta"):
            if getattr(self, name) <= 0:
                raise ValueError(f"VerifyConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("attack_restarts", "attack_steps", "alpha_iterations", "beta_iterations", "attack_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"VerifyConfig.{name} must be ≥ 0, got {getattr(self, name)}")
        for name in ("batch_size", "branching_candidates", "max_domains"):
            if getattr(self, name) < 1:
                raise ValueError(f"VerifyConfig.{name} must be ≥ 1, got {getattr(self, name)}")
