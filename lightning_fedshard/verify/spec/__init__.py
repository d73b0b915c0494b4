"""Verification specifications: VNN-LIB 1.0 properties and VNN-COMP counterexamples / result files."""

from lightning_fedshard.verify.spec.counterexample import (
    CheckResult,
    Counterexample,
    check_counterexample,
    format_counterexample,
    read_counterexample,
    write_result,
)
from lightning_fedshard.verify.spec.vnnlib import (
    Case,
    Disjunct,
    InputBox,
    Property,
    UnsupportedPropertyError,
    VnnlibError,
    local_robustness,
    parse_vnnlib,
    read_vnnlib,
)

__all__ = [
    "Case",
    "CheckResult",
    "Counterexample",
    "Disjunct",
    "InputBox",
    "Property",
    "UnsupportedPropertyError",
    "VnnlibError",
    "check_counterexample",
    "format_counterexample",
    "local_robustness",
    "parse_vnnlib",
    "read_counterexample",
    "read_vnnlib",
    "write_result",
]
