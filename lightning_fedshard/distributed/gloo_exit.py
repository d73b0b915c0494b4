"""A clean end for gloo process groups: destroy them while the interpreter is still alive."""

from __future__ import annotations

import atexit
import gc
from datetime import timedelta

import torch.distributed as dist

__all__ = ["destroy_process_group_at_exit"]

_registered = False


def destroy_process_group_at_exit() -> None:
    """Registers (once) an exit handler that meets every rank at a barrier, then destroys the process group.

    gloo may release a collective's last work object on its own thread after the interpreter has begun
    finalising, which aborts the process ("terminate called without an active exception"). Destroying the
    group while Python is alive releases it in time; the barrier first keeps a peer that is already exiting
    from seeing its connections drop. Call it only when every rank will reach the exit normally: the
    barrier waits up to a minute for each of them.
    """
    global _registered
    if not _registered:
        atexit.register(_destroy_process_group)
        _registered = True


def _destroy_process_group() -> None:
    gc.collect()
    if dist.is_initialized():
        dist.monitored_barrier(timeout=timedelta(seconds=60))
        dist.destroy_process_group()
    gc.collect()
