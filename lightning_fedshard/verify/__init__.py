"""Neural-network verification: ONNX + VNN-LIB in, IBP / CROWN / α-CROWN / β-CROWN branch-and-bound, verdicts out.

Example::

    from lightning_fedshard.verify import VerifyConfig, verify_files

    result = verify_files("mnist-net_256x2.onnx", "prop_0_0.03.vnnlib", VerifyConfig(timeout=120))
    result.verdict            # Verdict.UNSAT
    result.root_margins       # lower bounds of every disjunct row

Every way of running an instance answers with one :class:`VerificationResult` (``verdict`` ``error`` included):
:func:`verify`, :func:`verify_files`, :func:`run_instance` (a benchmark row), the predict loop's
:func:`run_predict` (``per_rank``: each rank's :class:`RankReport`).
"""

from lightning_fedshard.verify.config import Method, Verdict, VerifyConfig
from lightning_fedshard.verify.graph import BoundGraph, Node
from lightning_fedshard.verify.instances import Instance, read_instances, run_instance, run_instances
from lightning_fedshard.verify.memory import PeakMemoryMeter
from lightning_fedshard.verify.onnx import OnnxLoadError, load_onnx
from lightning_fedshard.verify.phases import CasePhases
from lightning_fedshard.verify.result import RankReport, VerificationResult
from lightning_fedshard.verify.shard.plan import ShardPlan, Strategy, TensorParallelMode
from lightning_fedshard.verify.spec import (
    Counterexample,
    Property,
    VnnlibError,
    check_counterexample,
    local_robustness,
    read_vnnlib,
    write_result,
)
from lightning_fedshard.verify.verifier import verify, verify_files

# The Lightning predict loop (and Lightning with it) loads on first use: a single-process run never needs it.
_LIGHTNING_EXPORTS = frozenset({"VerificationModule", "VnncompInstances", "run_predict"})


def __getattr__(name: str) -> object:
    if name in _LIGHTNING_EXPORTS:
        from lightning_fedshard.verify import lightning

        return getattr(lightning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BoundGraph",
    "CasePhases",
    "Counterexample",
    "Instance",
    "Method",
    "Node",
    "OnnxLoadError",
    "PeakMemoryMeter",
    "Property",
    "RankReport",
    "ShardPlan",
    "Strategy",
    "TensorParallelMode",
    "Verdict",
    "VerificationModule",
    "VerificationResult",
    "VerifyConfig",
    "VnncompInstances",
    "VnnlibError",
    "check_counterexample",
    "load_onnx",
    "local_robustness",
    "read_instances",
    "read_vnnlib",
    "run_instance",
    "run_instances",
    "run_predict",
    "verify",
    "verify_files",
    "write_result",
]
