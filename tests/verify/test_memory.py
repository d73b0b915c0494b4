import os

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_fedshard.verify.memory import PeakMemoryMeter, tensor_bytes

MiB = 2**20
FLOATS_PER_MIB = MiB // 4


def test_peak_of_two_freed_allocations_is_their_sum():
    resident = 12345
    meter = PeakMemoryMeter(device=torch.device("cpu"), resident_bytes=resident)
    with meter:
        a = torch.empty(100 * FLOATS_PER_MIB)
        b = torch.empty(100 * FLOATS_PER_MIB)
        assert meter.live_bytes == resident + 200 * MiB
        del a, b
        assert meter.live_bytes == resident
    assert meter.peak_bytes == resident + 200 * MiB
    assert meter.baseline_bytes == resident
    assert meter.live_bytes == resident


def test_views_and_in_place_ops_count_a_storage_once():
    n = FLOATS_PER_MIB
    meter = PeakMemoryMeter()
    with meter:
        x = torch.zeros(n)
        strided, reshaped, flat = x[::2], x.view(2, n // 2), x.view(-1)
        x.add_(1)
        strided.mul_(3)
        a, b, c = torch.ones(n), torch.ones(n), torch.empty(n)
        torch.add(a, b, out=c)
        assert meter.live_bytes == 4 * MiB  # x, a, b, c
        del x, strided, reshaped
        assert meter.live_bytes == 4 * MiB  # `flat` still holds x's storage
        del flat
        assert meter.live_bytes == 3 * MiB
    assert meter.peak_bytes == 4 * MiB


def test_views_and_in_place_ops_on_outside_tensors_count_nothing():
    outside = torch.zeros(FLOATS_PER_MIB)
    other = torch.ones(FLOATS_PER_MIB)
    meter = PeakMemoryMeter()
    with meter:
        outside.add_(1)
        view = outside[1:].view(-1, 1).t()
        torch.mul(other, 2, out=outside)
        assert meter.live_bytes == 0
        del view
    assert meter.peak_bytes == 0


def test_temporaries_count_but_inputs_from_outside_do_not():
    a = torch.ones(10 * FLOATS_PER_MIB)
    meter = PeakMemoryMeter()
    with meter:
        result = a * 2 + 1  # the product is a temporary that lives until the sum exists
        assert meter.live_bytes == 10 * MiB
    assert meter.peak_bytes == 20 * MiB
    assert torch.equal(result, torch.full_like(a, 3.0))


def test_ops_with_several_outputs_count_each_output():
    values = torch.randn(1024)
    meter = PeakMemoryMeter()
    with meter:
        sorted_values, indices = torch.sort(values)
    assert meter.peak_bytes == 1024 * 4 + 1024 * 8
    assert sorted_values.dtype == torch.float32 and indices.dtype == torch.int64


def test_out_argument_that_grows_is_counted():
    a, b = torch.ones(1000), torch.ones(1000)
    meter = PeakMemoryMeter()
    with meter:
        out = torch.empty(0)
        torch.add(a, b, out=out)
        assert meter.live_bytes == 4000
        del out
        assert meter.live_bytes == 0
    assert meter.peak_bytes == 4000


def test_resident_bytes_and_baseline():
    resident = 1000
    meter = PeakMemoryMeter(resident_bytes=resident)
    with meter:
        setup = torch.empty(256)  # 1 KiB alive when the baseline is marked
        meter.mark_baseline()
        temporary = torch.empty(1024)  # 4 KiB on top of it, freed again
        del temporary
        assert meter.live_bytes == resident + 1024
    assert meter.baseline_bytes == resident + 1024
    assert meter.peak_bytes == resident + 1024 + 4096
    del setup


def test_baseline_defaults_to_resident_bytes():
    meter = PeakMemoryMeter(resident_bytes=777)
    with meter:
        kept = torch.empty(100)
    assert meter.baseline_bytes == 777
    assert meter.peak_bytes == 777 + 400
    del kept


def test_tensor_bytes_counts_shared_storages_once():
    weight = torch.empty(10, 10)
    tied = weight.t()
    row = weight[3]
    bias = torch.empty(10, dtype=torch.float64)
    assert tensor_bytes([weight, tied, row, bias]) == 400 + 80
    assert tensor_bytes([torch.empty(5, device="meta"), torch.empty(0)]) == 0
    assert tensor_bytes(torch.nn.Linear(8, 4).parameters()) == (8 * 4 + 4) * 4


def test_entering_an_active_meter_raises():
    meter = PeakMemoryMeter()
    with meter:
        with pytest.raises(RuntimeError, match="already active"):
            meter.__enter__()
        x = torch.empty(10)
    assert meter.peak_bytes == 40
    del x


def test_mark_baseline_outside_the_block_raises():
    with pytest.raises(RuntimeError, match="inside"):
        PeakMemoryMeter().mark_baseline()


def test_meter_is_reusable_and_survives_an_exception():
    meter = PeakMemoryMeter()
    with pytest.raises(ValueError), meter:
        big = torch.empty(1000)
        raise ValueError("propagation failed")
    assert meter.peak_bytes == 4000
    assert _get_current_dispatch_mode() is None
    del big
    with meter:
        small = torch.empty(10)
    assert meter.peak_bytes == 40  # starts from zero, not from the first use
    del small


def test_storage_freed_after_exit_changes_nothing():
    meter = PeakMemoryMeter()
    with meter:
        result = torch.empty(1000)
        view = result[::2]
    assert (meter.live_bytes, meter.peak_bytes) == (4000, 4000)
    del result, view
    torch.empty(10_000)  # ops after exit are not counted either
    assert (meter.live_bytes, meter.peak_bytes) == (4000, 4000)


def test_tensor_saved_for_backward_counts_until_backward_frees_it():
    n = FLOATS_PER_MIB
    x = torch.randn(n, requires_grad=True)
    meter = PeakMemoryMeter()
    with meter:
        h = x.exp()  # exp saves its result for backward
        loss = h.sum()
        del h
        assert meter.live_bytes == MiB + 4  # h is still held by the graph, plus the 0-dim loss
        (grad,) = torch.autograd.grad(loss, x)  # frees the graph and with it h
        assert meter.live_bytes == MiB + 4  # now the gradient instead of h
        del grad, loss
        assert meter.live_bytes == 0
    # During backward h, the gradient, the loss and the 0-dim seed gradient are alive at once.
    assert 2 * MiB + 4 <= meter.peak_bytes <= 2 * MiB + 64


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise KeyError(field)


def _can_reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # 5 resets VmHWM (peak RSS) to the current RSS
        return True
    except OSError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc/self/clear_refs")
def test_agrees_with_linux_peak_rss():
    if not _can_reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable")
    rss_before = _proc_status_bytes("VmRSS")
    meter = PeakMemoryMeter()
    with meter:
        touched = torch.ones(400 * FLOATS_PER_MIB)  # ones writes every page, so all of it becomes resident
        del touched
    rss_peak_growth = _proc_status_bytes("VmHWM") - rss_before
    assert meter.peak_bytes == 400 * MiB
    assert abs(rss_peak_growth - meter.peak_bytes) <= 0.1 * meter.peak_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_uses_allocator_statistics():
    device = torch.device("cuda")
    meter = PeakMemoryMeter(device=device, resident_bytes=10**9)  # ignored: the allocator sees the weights
    with meter:
        kept = torch.empty(FLOATS_PER_MIB, device=device)
        meter.mark_baseline()
        with pytest.raises(RuntimeError, match="another PeakMemoryMeter"):
            PeakMemoryMeter(device=device).__enter__()
        temporary = torch.empty(100 * FLOATS_PER_MIB, device=device)
        del temporary
    assert meter.baseline_bytes >= MiB
    assert meter.peak_bytes - meter.baseline_bytes == 100 * MiB
    assert meter.peak_bytes < 10**9
    del kept
