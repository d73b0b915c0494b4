"""The host-synchronisation counter on the CPU: each kind of op that makes a CUDA run wait counts once, at the
line of the caller, in the phase it ran in; reading a tensor already copied to the host costs nothing more; a
verification run's phases and branch-and-bound rounds are attributed."""

from __future__ import annotations

import sys

import torch

from lightning_fedshard.verify import VerifyConfig, verify_files
from lightning_fedshard.verify.syncs import SyncCounter, note_round, phase
from tests.verify.test_verify_cli import files  # noqa: F401 (fixture)


def _line() -> int:
    return sys._getframe(1).f_lineno


def test_each_synchronising_op_counts_once_at_its_caller():
    x = torch.arange(6.0)
    with SyncCounter(assume_device=True) as syncs:
        first = _line() + 1
        x[1].item(), bool(x[2] > 0), x.tolist(), int(x[3]), float(x[4]), f"{x[5]:.1f}"  # six reads
        x.nonzero(), x[x > 2], torch.unique(x), torch.where(x > 1)  # four data-dependent sizes
        x[x > 4] = 0.0  # a masked write: one more
        torch.tensor([1.0, 2.0], device=x.device)  # host data onto the device: an upload
        host = x.cpu()  # one read (the copy) ...
        host.tolist(), host[0].item(), host.numpy()  # ... then free: the values are on the host already
        x + 1, x[torch.tensor([0, 2])], x.sum().clamp(min=0), (x > 0).any()  # stay on the device: none
    here = "tests/verify/test_syncs.py:{} (test_each_synchronising_op_counts_once_at_its_caller)"
    assert syncs.top(10) == [
        (here.format(first), "read", 6),
        (here.format(first + 1), "size", 4),
        (here.format(first + 2), "size", 1),
        (here.format(first + 3), "upload", 1),
        (here.format(first + 4), "read", 1),
    ]


def test_on_the_cpu_without_assume_device_nothing_counts():
    x = torch.arange(6.0)
    with SyncCounter(assume_device=False) as syncs:
        x[1].item(), x.nonzero(), x.tolist()
    assert syncs.total == 0


def test_phases_and_rounds_are_attributed():
    x = torch.ones(3)
    with SyncCounter(assume_device=True) as syncs:
        with phase("bab"):
            for _ in range(3):
                bool(x.all())
                note_round()
        x.tolist()
    note_round()  # no counter in force: nothing
    assert syncs.by_phase() == {"bab": 3, "other": 1} and dict(syncs.rounds) == {"bab": 3}


def test_a_verification_run_is_counted_per_phase(files):  # noqa: F811
    with SyncCounter(assume_device=True) as syncs:
        result = verify_files(*files, VerifyConfig(timeout=30))
    assert result.verdict.value == "unsat" and syncs.total > 0
    assert "attack" in syncs.by_phase() and set(syncs.by_phase()) - {"other"} <= set(result.times)
    assert all(site.startswith("lightning_fedshard/") for site, _, _ in syncs.top(5))


def test_splitting_domains_waits_for_nothing():
    """Which domains split which node stays on the device (it was a ``nonzero`` per node and round)."""
    from tests.verify.test_domains import _domains

    parents = _domains(torch.tensor([4, 7, 9]))
    with SyncCounter(assume_device=True) as syncs:
        parents.split(["z"], torch.tensor([0, 0, 1]), torch.tensor([1, 2, 0]), torch.tensor([0.0, 2.5, 1.0]))
    assert syncs.total == 0, syncs.top(3)


def test_coefficients_of_the_same_rows_read_their_positions_once():
    """The steps of a pass through patches share the rows' layout: read at the first step, not at each."""
    from lightning_fedshard.verify.ops.patches import Patches

    rows = Patches.identity(torch.tensor([0, 17, 40, 41]), batch=1, shape=(4, 8, 8), dtype=torch.float32)
    value = torch.rand(1, 4, 8, 8) + 0.5
    with SyncCounter(assume_device=True) as first:
        rows * value
    with SyncCounter(assume_device=True) as later:
        (-(rows * value) * value).contract(value)
    assert first.total > 0 and later.total == 0, later.top(3)


def test_a_select_transposes_without_waiting():
    from lightning_fedshard.verify.ops.structural import Select

    pick = Select(torch.tensor([1, -1, 0, 2]), in_shape=(3,), out_shape=(4,), fill=torch.zeros(4))
    A = torch.arange(8.0).view(2, 1, 4)
    with SyncCounter(assume_device=True) as syncs:
        A_in = pick.transpose(A)
    assert syncs.total == 0 and A_in.tolist() == [[[2.0, 0.0, 3.0]], [[6.0, 4.0, 7.0]]]
