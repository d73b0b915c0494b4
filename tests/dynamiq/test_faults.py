"""Bad and unusual tensors in the compressed collectives: NaN on one rank, integer, bool, complex and empty tensors,
groups of one — on 2 real gloo processes, and in the in-process simulation."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from lightning_fedshard.dynamiq import CODECS, make_codec, simulate_all_reduce
from lightning_fedshard.dynamiq.baselines.floats import NoneCodec
from tests.dynamiq.fault_worker import complex_input, counts, rank_input
from tests.launching import run_isolated

WORKER = Path(__file__).with_name("fault_worker.py")
#: Twice what DynamiQ at 5 bits measures on the worker's Gaussian 2-rank sum.
MAX_VNMSE = 1.2e-2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("faults")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = run_isolated([*launcher, str(WORKER), str(out)])
    assert result.returncode == 0, result.stderr[-6000:]  # both ranks exit cleanly after the errors
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def vnmse(estimate: torch.Tensor, exact: torch.Tensor) -> float:
    return float((estimate.double() - exact).square().sum() / exact.square().sum())


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "case,codec,bad_rank",
    [("nan_ring", "dynamiq", 1), ("nan_butterfly", "dynamiq", 1), ("inf_reduce_scatter", "dynamiq", 0),
     ("nan_thc", "thc", 1)],
)  # fmt: skip
def test_nan_on_one_rank_raises_the_same_error_on_both(ranks, case, codec, bad_rank) -> None:
    # a rank left waiting for the one that raised would have recorded the group's 20 s timeout instead
    errors = [r[case]["error"] for r in ranks]
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"ValueError: {codec}: the tensor holds NaN or Inf values on rank {bad_rank} of 2")


@pytest.mark.multiproc
def test_the_ranks_stay_in_step_after_the_errors(ranks) -> None:
    after = [r["after"] for r in ranks]
    assert all(a["error"] is None and a["identical"] for a in after)
    assert vnmse(after[0]["result"], rank_input(0).double() + rank_input(1).double()) < MAX_VNMSE


@pytest.mark.multiproc
def test_integer_and_bool_tensors_are_summed_exactly(ranks) -> None:
    for r in ranks:
        assert torch.equal(r["int64"]["result"], counts(0) + counts(1))  # 2^41-sized sums, far beyond fp32
        # gloo sums bool tensors as a logical or
        assert torch.equal(r["bool"]["result"], (rank_input(0) > 1.5) | (rank_input(1) > 1.5))


@pytest.mark.multiproc
def test_complex_tensors_are_compressed_as_their_real_and_imaginary_parts(ranks) -> None:
    results = [r["complex"]["result"] for r in ranks]
    assert results[0].dtype == torch.complex64 and torch.equal(results[0], results[1])
    exact = complex_input(0).to(torch.complex128) + complex_input(1).to(torch.complex128)
    assert vnmse(results[0].real, exact.real) < MAX_VNMSE
    assert vnmse(results[0].imag, exact.imag) < MAX_VNMSE


@pytest.mark.multiproc
def test_empty_tensors_and_groups_of_one(ranks) -> None:
    for rank, r in enumerate(ranks):
        assert r["empty"]["error"] is None and r["empty"]["result"].numel() == 0
        assert r["empty_reduce_scatter"]["error"] is None and r["empty_reduce_scatter"]["result"].numel() == 0
        assert torch.equal(r["world_of_one"]["result"], rank_input(rank))


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_the_simulation_raises_the_distributed_error_for_nan_on_one_rank(codec) -> None:
    inputs = [torch.randn(4096, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    inputs[2][100] = float("nan")
    name = make_codec(codec, 4).name  # dynamiq_sr is DynamiQ with stochastic rounding
    with pytest.raises(ValueError, match=f"^{name}: the tensor holds NaN or Inf values on rank 2 of 4"):
        simulate_all_reduce(inputs, codec=codec, bits=4)


class _FailsOnTheAnswer(NoneCodec):
    """Raises in the one simulated rank whose first message holds 42, in the middle of the ring."""

    name = "fails_on_42"

    def encode(self, x: torch.Tensor, summands: int) -> torch.Tensor:
        if bool((x == 42).any()):
            raise RuntimeError("no code for 42")
        return super().encode(x, summands)


def test_a_failing_simulated_rank_stops_the_others_and_its_error_is_raised() -> None:
    inputs = [torch.randn(4096, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    inputs[1][0] = 42.0  # rank 1 encodes chunk 0 first: the others wait for its message
    raised: list[BaseException] = []

    def simulate() -> None:
        try:
            simulate_all_reduce(inputs, codec=_FailsOnTheAnswer())
        except BaseException as error:  # noqa: BLE001 -- handed to the test's thread
            raised.append(error)

    runner = threading.Thread(target=simulate, daemon=True)
    runner.start()
    runner.join(timeout=60)  # a hang guard, not a timing check: the run takes milliseconds
    assert not runner.is_alive(), "the other simulated ranks kept waiting for the failed one"
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError) and str(raised[0]) == "no code for 42"


def test_the_simulation_sums_integer_bool_and_complex_tensors_as_the_collective_does() -> None:
    world = 3
    ints = [counts(r) for r in range(world)]
    total, bits = simulate_all_reduce(ints, codec="dynamiq")
    assert torch.equal(total, sum(ints)) and bits == 64
    masks = [rank_input(r) > 1.5 for r in range(world)]
    assert torch.equal(simulate_all_reduce(masks)[0], masks[0] | masks[1] | masks[2])
    values = [complex_input(r) for r in range(world)]
    total, bits = simulate_all_reduce(values, codec="dynamiq", bits=5.0)
    exact = sum(v.to(torch.complex128) for v in values)
    assert total.dtype == torch.complex64 and bits <= 5.0
    assert vnmse(total.real, exact.real) < MAX_VNMSE and vnmse(total.imag, exact.imag) < MAX_VNMSE


def test_the_simulation_of_one_rank_or_of_empty_tensors_sends_nothing() -> None:
    x = torch.randn(4096)
    total, bits = simulate_all_reduce([x])
    assert torch.equal(total, x) and bits == 0.0
    total, bits = simulate_all_reduce([torch.empty(0)] * 4)
    assert total.numel() == 0 and bits == 0.0
