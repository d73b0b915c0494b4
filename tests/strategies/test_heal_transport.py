"""The stream heal transport: a peer's state arrives bit for bit in the receiver's own tensors, chunk by chunk, with
no copy of the state on either side; a mismatched model is refused before any byte lands; a transfer that breaks
after bytes landed says so. Two gloo ranks in two threads of this process."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_fedshard.strategies.heal_transport import StreamingTransport

TIMEOUT = timedelta(seconds=30)
MIB = 1 << 20


def pair(timeout: timedelta) -> list[dist.ProcessGroup]:
    store = dist.HashStore()
    groups: list = [None, None]

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("heal", store), rank, 2, timeout)

    threads = [threading.Thread(target=make, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return groups


def state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "user": {
            "params": {
                "w": torch.randn(6 * MIB + 5, generator=generator),  # 24 MiB and a bit: split across chunks
                "b": torch.randn(7, 3, generator=generator),
                "flag": torch.tensor([seed % 2 == 0]),
                "half": torch.randn(1000, generator=generator).to(torch.bfloat16),
            },
            "outer": {"momentum": {"w": torch.randn(MIB // 4, generator=generator)}},
            "progress": {"step": seed, "lr": [0.1 * seed]},
        },
        "torchft": {"step": seed, "batches_committed": 2 * seed},
    }


def transfer(send_state: dict, recv_state: dict, timeout: timedelta = TIMEOUT, wrap=lambda pg: pg) -> tuple[dict, int]:
    """Sends ``send_state`` from rank 0 into rank 1's ``recv_state`` (through ``wrap`` of its process group) in 1 MiB
    chunks; returns what rank 1's receive returned and the peak resident memory above the memory before, in KiB (both
    ranks are this process)."""
    groups = pair(timeout)
    sender = StreamingTransport(groups[0], timeout, lambda: send_state, chunk_bytes=MIB, window=2)
    receiver = StreamingTransport(wrap(groups[1]), timeout, lambda: recv_state, chunk_bytes=MIB, window=2)
    received: dict = {}
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            received["state"] = receiver.recv_checkpoint(0, receiver.metadata(), 5, timeout)
        except BaseException as error:  # noqa: BLE001 -- handed to the test thread
            errors.append(error)

    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    before = _status_kb("VmRSS")
    thread = threading.Thread(target=receive)
    thread.start()
    try:
        sender.send_checkpoint([1], 5, send_state, timeout)
    except RuntimeError:
        pass  # the receiver broke off: the test looks at the receiver
    thread.join()
    peak = _status_kb("VmHWM") - before
    received["transport"] = receiver
    if errors:
        received["error"] = errors[0]
    return received, peak


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))


def leaves(tree: dict) -> dict:
    from torch.utils._pytree import tree_flatten_with_path

    return dict(tree_flatten_with_path(tree)[0])


def test_the_peers_state_lands_bit_for_bit_in_the_receivers_own_tensors_without_a_copy_of_it():
    peer, mine = state(1), state(2)
    live = leaves(mine)
    received, peak_kb = transfer(peer, mine)
    assert "error" not in received
    got = leaves(received["state"])
    assert got.keys() == leaves(peer).keys()
    nbytes = 0
    for path, value in leaves(peer).items():
        if isinstance(value, torch.Tensor):
            assert got[path] is live[path]  # received into the live tensor itself
            assert torch.equal(live[path].view(-1).view(torch.uint8), value.view(-1).view(torch.uint8)), path
            nbytes += value.numel() * value.element_size()
        else:
            assert got[path] == value
    assert received["transport"].bytes_moved == nbytes and not received["transport"].torn
    # no copy of the 28 MiB state on either side (torchft's HTTP transport holds one on each): a few chunks at most
    assert peak_kb * 1024 < nbytes / 4, (peak_kb, nbytes)


def test_a_receiver_of_another_shape_is_refused_before_any_byte_lands():
    peer, mine = state(1), state(2)
    mine["user"]["params"]["b"] = torch.zeros(3, 7)
    before = {k: v.clone() for k, v in leaves(mine).items() if isinstance(v, torch.Tensor)}
    received, _ = transfer(peer, mine, timedelta(seconds=3))  # the sender waits for it that long, then fails
    assert isinstance(received["error"], ValueError)
    assert "params']['b']" in str(received["error"]) and "(7, 3) torch.float32" in str(received["error"])
    assert all(torch.equal(leaves(mine)[k], v) for k, v in before.items())
    assert not received["transport"].torn


class _BreaksAfter:
    """A process group whose receives fail once ``receives`` have been posted (a peer dying mid-transfer)."""

    def __init__(self, pg: dist.ProcessGroup, receives: int) -> None:
        self.pg, self.left = pg, receives

    def recv(self, tensors, src, tag):
        if self.left == 0:
            raise RuntimeError("peer gone")
        self.left -= 1
        return self.pg.recv(tensors, src, tag)


@pytest.mark.parametrize("receives", [1, 4])
def test_a_transfer_broken_after_bytes_landed_is_reported_torn(receives):
    peer, mine = state(1), state(2)
    received, _ = transfer(peer, mine, timedelta(seconds=3), lambda pg: _BreaksAfter(pg, receives))
    assert isinstance(received["error"], RuntimeError)
    # the header is two receives: broken before the first chunk the state is untouched, after it is torn
    assert received["transport"].torn == (receives > 2)
