"""One timeout for every process group of a run: torch gives groups created after ``init_process_group`` its
own default (30 minutes, 10 for NCCL) unless each is told otherwise."""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_fedshard.compat import C10dBackend

__all__ = ["check_timeout", "init_device_mesh_with_timeout"]


def check_timeout(timeout: timedelta | str | None, owner: str) -> timedelta | None:
    """``timeout`` as a positive ``timedelta``, or ``None`` (torch's default); a clear error otherwise.

    A string in ``timedelta``'s own form (``"0:00:30"``, ``"1 day, 2:00:00"``, as YAML configs hold it) is read.
    """
    if timeout is None:
        return None
    if isinstance(timeout, str):
        timeout = _parse_timedelta(timeout, owner)
    if not isinstance(timeout, timedelta):
        raise TypeError(f"{owner}: `timeout` must be a datetime.timedelta (e.g. 0:00:30) or None, got {timeout!r}.")
    if timeout <= timedelta(0):
        raise ValueError(
            f"{owner}: `timeout` must be a positive duration, got {timeout} (the time a collective may wait for"
            " the other ranks before the run fails)."
        )
    return timeout


def _parse_timedelta(text: str, owner: str) -> timedelta:
    match = re.fullmatch(r"\s*(?:(-?\d+) days?, )?(\d+):(\d{1,2}):(\d{1,2}(?:\.\d+)?)\s*", text)
    if match is None:
        raise ValueError(f"{owner}: `timeout={text!r}` is not a duration like '0:00:30' or '1 day, 0:00:00'.")
    days, hours, minutes, seconds = match.groups()
    return timedelta(days=int(days or 0), hours=int(hours), minutes=int(minutes), seconds=float(seconds))


def init_device_mesh_with_timeout(
    device_type: str, mesh_shape: Sequence[int], mesh_dim_names: Sequence[str], timeout: timedelta | None
) -> DeviceMesh:
    """``init_device_mesh`` whose every dimension's process groups wait at most ``timeout`` in a collective
    (``None``: torch's default). Needs an initialised default process group."""
    override = None
    if timeout is not None:
        # one options object per dimension: NCCL writes each group's name and ranks into the options it is given
        override = {name: _group_options(timeout) for name in mesh_dim_names}
    return init_device_mesh(
        device_type, tuple(mesh_shape), mesh_dim_names=tuple(mesh_dim_names), backend_override=override
    )


def _group_options(timeout: timedelta) -> C10dBackend.Options:
    # The mesh reads a group's timeout from its options. NCCL checks their type; gloo uses only the timeout.
    backend = str(dist.get_backend())
    if "nccl" in backend:
        from torch.distributed import ProcessGroupNCCL  # absent from CPU builds of torch

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    return C10dBackend.Options(backend, timeout)
