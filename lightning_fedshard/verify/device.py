"""Where a verification run computes: the device name a user gives (``cpu``, ``cuda``, ``cuda:N``, ``auto``) and
the device one rank of a run puts its model, boxes, bounds and domains on."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["DEVICE_CHOICES", "check_device", "full_precision", "resolve_device"]

#: The names ``fedshard verify --device`` takes (``VerifyConfig.device`` also takes ``cuda:N``).
DEVICE_CHOICES = ("cpu", "cuda", "auto")


def check_device(name: str) -> str:
    """``name`` if a run here can compute on it; a ``ValueError`` naming the problem otherwise (``cuda`` on a
    machine without CUDA, a GPU index beyond the ones there, a device type the verifier does not run on).

    >>> check_device("cpu")
    'cpu'
    """
    resolve_device(name, local_rank=0)
    return name


@contextmanager
def full_precision() -> Iterator[None]:
    """float32 matrix products and convolutions in full float32 inside the block, TF32 switched off (torch 2.13
    lets cuDNN convolutions use TF32's 10-bit mantissa by default, which no float32 error bound covers); the
    settings are restored after it.

    Example::

        with full_precision():
            result = verify(graph, prop)
    """
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """The device for ``name`` on the rank with ``local_rank`` (default: ``$LOCAL_RANK``, else 0).

    ``auto`` is ``cuda`` where CUDA is available, else ``cpu``; ``cuda`` is GPU ``local_rank % device_count`` (each
    rank of a node on its own GPU, ranks sharing GPUs round-robin where there are fewer); ``cuda:N`` is GPU N.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if not isinstance(name, str):
        raise ValueError(f"a device is named by a string (cpu, cuda, cuda:N or auto), got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use cpu, cuda, cuda:N or auto") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"the verifier runs on cpu or cuda, not {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available on this machine (use --device cpu or auto)")
    count = torch.cuda.device_count()
    if device.index is None:
        rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        return torch.device("cuda", rank % count)
    if device.index >= count:
        raise ValueError(f"device {name!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device
