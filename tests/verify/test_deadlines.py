"""A timeout is a promise: on the CIFAR conv nets of cifar_biasfield (16 free input dimensions, so the first attack
takes 10,000 starts, each a forward and backward pass of a conv net) every phase returns by the deadline."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_fedshard.bench.gpu_check import vnncomp_root
from lightning_fedshard.verify import Verdict, VerifyConfig, verify_files

ROOT = vnncomp_root()
CIFAR = None if ROOT is None else ROOT / "cifar_biasfield_2022"
pytestmark = pytest.mark.skipif(
    CIFAR is None or not CIFAR.is_dir(), reason="cifar_biasfield_2022 of the VNN-COMP files is absent"
)

#: Seconds past the timeout a run may take on a loaded CI machine (the phases stop at their next check, and the
#: slowest check interval is one chunk of the attack or one bound step).
MARGIN_S = 2.0


@pytest.mark.parametrize("instance", [0, 1])
def test_a_cifar_biasfield_instance_returns_by_a_short_timeout(instance: int) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `fedshard verify --threads 1`, where an unchecked attack took 30 s of 8
    try:
        timeout = 4.0
        start = time.monotonic()
        result = verify_files(
            CIFAR / "onnx" / f"cifar_bias_field_{instance}.onnx.gz",
            CIFAR / "vnnlib" / f"prop_{instance}.vnnlib",
            VerifyConfig(timeout=timeout),
        )
        wall = time.monotonic() - start
    finally:
        torch.set_num_threads(threads)
    assert result.verdict in (Verdict.TIMEOUT, Verdict.UNSAT)  # both are unsat in the official results
    assert wall < timeout + MARGIN_S, f"{wall:.1f} s at a {timeout} s timeout: {result.times}"


PENSIEVE = None if ROOT is None else ROOT / "nn4sys_pensieve_2023"


@pytest.mark.skipif(
    PENSIEVE is None or not PENSIEVE.is_dir(), reason="nn4sys_pensieve_2023 of the VNN-COMP files is absent"
)
def test_the_largest_pensieve_instance_returns_by_a_short_timeout() -> None:
    """Input splitting on pensieve_big_parallel: one batch's intermediate-bound pass took seconds and did not look
    at the deadline (a 5 s run took 7.2–7.5 s); now every pass of the search stops at it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        timeout = 4.0
        start = time.monotonic()
        result = verify_files(
            PENSIEVE / "onnx" / "pensieve_big_parallel.onnx.gz",
            PENSIEVE / "vnnlib" / "pensieve_parallel_70.vnnlib",
            VerifyConfig(timeout=timeout),
        )
        wall = time.monotonic() - start
    finally:
        torch.set_num_threads(threads)
    assert result.verdict in (Verdict.TIMEOUT, Verdict.UNSAT)  # unsat in the official results
    assert wall < timeout + MARGIN_S, f"{wall:.1f} s at a {timeout} s timeout: {result.times}"
