"""DynamiQ on a GPU: the Triton DAR kernels compiled (not interpreted) byte for byte equal to the torch codec for
every width mix, and the compressed collectives on CUDA tensors through gloo (two ranks on one GPU; NCCL between
ranks needs a GPU each, which a one-GPU machine does not have). Marked ``cuda``: ``pytest -m cuda`` runs them
(``make gpu-check``); they skip without CUDA."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from lightning_fedshard.dynamiq import simulate_all_reduce
from lightning_fedshard.dynamiq.dynamiq_codec import DynamiQCodec
from lightning_fedshard.dynamiq.dynamiq_format import SUPER_GROUP, WIDTHS, split_message
from tests.dynamiq.collective_worker import TOPOLOGIES, rank_input
from tests.dynamiq.test_collective import MAX_VNMSE, vnmse
from tests.dynamiq.test_dynamiq_codec import ANY_SIZES, quantization_bound, zero_padded
from tests.dynamiq.test_triton_dar import DATA, assert_same_bytes, gaussian, reference_dar
from tests.launching import run_isolated

pytestmark = pytest.mark.cuda

#: From the lowest rate to the top one: few bits leave most groups at width 0 or 2, many at 8; together the
#: messages use every width (checked).
BITS = (1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 8.4)
NUMEL = 1 << 18  # compiled kernels: thousands of programs per launch, as in training
CODECS = ("dynamiq", "dynamiq_sr", "int8", "none")
WORKER = Path(__file__).with_name("collective_worker.py")


def _widths(codec: DynamiQCodec, msg: torch.Tensor, summands: int) -> set[int]:
    budget = codec.payload_bits(summands) * (NUMEL // SUPER_GROUP)
    return set(split_message(msg, NUMEL, budget)[2].unique().tolist())


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_compiled_dar_is_bit_exact_for_every_width_mix(rounding: str) -> None:
    from lightning_fedshard.dynamiq import triton_dar

    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "the kernels must be compiled, not interpreted"
    seen: set[int] = set()
    for bits in BITS:
        codec = DynamiQCodec(bits, rounding=rounding, seed=5)
        for data in ("heavy_tailed", "zeros", "outlier"):
            received, local = DATA[data](NUMEL, 0).cuda(), DATA[data](NUMEL, 1).cuda()
            for summands in (1, 2, 7):
                codec.calls = summands
                msg = codec.encode(received, summands)
                expected = reference_dar(codec, msg, local, summands)
                assert_same_bytes(triton_dar.encode(codec, received, summands), msg)
                assert_same_bytes(triton_dar.dar(codec, msg, local, summands), expected)
                seen |= _widths(codec, expected, summands + 1)
    assert seen == set(WIDTHS)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_any_size_on_cuda_decodes_to_its_own_size(rounding: str) -> None:
    """Issue 32 on CUDA: a size that is not whole super-groups sends the zero-padded tensor's message, decodes to
    exactly its size within the quantization bound, and accumulates (the fused Triton DAR takes whole super-groups
    only) as decode + add + encode."""
    for numel in ANY_SIZES:
        codec = DynamiQCodec(5.0, rounding=rounding, seed=3)
        x, y = gaussian(numel, 0).cuda(), gaussian(numel, 1).cuda()
        msg = codec.encode(x, 1)
        assert msg.is_cuda and msg.numel() == codec.message_bytes(numel, 1)
        assert_same_bytes(msg, codec.encode(zero_padded(x), 1))
        x_hat = codec.decode(msg, numel, 1)
        assert x_hat.shape == (numel,)
        assert torch.all((x_hat - x).abs().double().cpu() <= quantization_bound(codec, msg.cpu(), numel, 1))
        total = codec.accumulate(msg, y, 1)
        assert_same_bytes(total, reference_dar(codec, msg, y, 1))
        error = (codec.decode(total, numel, 2) - (x_hat + y)).abs().double().cpu()
        assert torch.all(error <= quantization_bound(codec, total.cpu(), numel, 2))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("collective_cuda")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = run_isolated([*launcher, str(WORKER), str(out), "cuda", *CODECS], timeout=240)
    assert result.returncode == 0, result.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.multiproc
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("codec", CODECS)
def test_collectives_on_cuda_tensors_through_gloo(ranks, codec: str, topology: str) -> None:
    records = [r["all_reduce"][codec, topology] for r in ranks]
    assert all(rec["device"].startswith("cuda") for rec in records)
    assert all(rec["identical"] for rec in records)
    assert torch.equal(records[0]["result"], records[1]["result"])
    inputs = [rank_input(r) for r in range(2)]
    assert vnmse(records[0]["result"], sum(x.double() for x in inputs)) <= MAX_VNMSE[codec]
    simulated, _ = simulate_all_reduce([x.cuda() for x in inputs], codec=codec, bits=5.0, topology=topology)
    assert torch.equal(simulated.cpu(), records[0]["result"])  # the same kernels and bytes in one process
    assert all(r["small_fallback_equal"] for r in ranks)
