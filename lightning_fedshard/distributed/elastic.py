"""Restarts in place under ``torchrun --max-restarts``: refused up front where torch cannot give them a clean store.

torchrun's agent restarts a worker group in place when a worker dies, which is how a fault-tolerant federation
group is meant to come back fast (no new job, no new agent; see docs/fault_tolerance.md). But where the agent
shares its own rendezvous store with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``: always under
``--rdzv-backend=static``, the default with ``--master-port``; under ``c10d`` unless
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), the restarted workers find their predecessors' keys in it: torch 2.13's
``init_process_group`` and ``new_group`` then read a dead rank's address and fail to connect, or wait forever in the
store barrier (pytorch/pytorch#135712). Measured with a bare torch script: both rendezvous kinds fail on the first
restart with the shared store, ``c10d`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` restarts cleanly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["SHARE_STORE_SWITCH", "check_elastic_restarts"]

#: The environment variable that makes torchrun's c10d rendezvous give each restart a store of its own.
SHARE_STORE_SWITCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def check_elastic_restarts(environ: Mapping[str, str] | None = None) -> None:
    """Raises before any process group starts where torchrun would restart this run's workers on a shared store.

    Example::

        check_elastic_restarts()  # in every worker, before init_process_group
    """
    env = os.environ if environ is None else environ
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not restarts.isdigit() or int(restarts) == 0:
        return
    raise RuntimeError(
        f"torchrun --max-restarts={restarts} with the agent's rendezvous store shared with the workers: a restarted"
        " worker would read its dead predecessor's address from that store and fail to connect or hang"
        " (torch 2.13, pytorch/pytorch#135712). Launch with `--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT` (or"
        f" `--standalone` on one machine) and {SHARE_STORE_SWITCH}=1 in torchrun's environment, or with"
        " --max-restarts=0."
    )
