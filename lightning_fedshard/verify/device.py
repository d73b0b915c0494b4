"""Where a verification run computes: the device name a user gives (``cpu``, ``cuda``, ``cuda:N``, ``auto``) and
the device one rank of a run puts its model, boxes, bounds and domains on."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch.utils.flop_counter import FlopCounterMode

if TYPE_CHECKING:
    from lightning_fedshard.verify.graph import BoundGraph

__all__ = ["AUTO_CUDA_FLOPS", "DEVICE_CHOICES", "bound_pass_flops", "check_device", "full_precision", "resolve_device"]

#: The names ``fedshard verify --device`` takes (``VerifyConfig.device`` also takes ``cuda:N``).
DEVICE_CHOICES = ("cpu", "cuda", "auto")

#: ``auto`` computes on CUDA from this many FLOPs of one bound pass (:func:`bound_pass_flops`) up. A CUDA kernel
#: costs 5–10 µs to launch whatever its size, and a pass launches ~10 per node; one CPU core does ~27 GFLOP/s on
#: these passes (mnist_fc 256x6's CROWN: six passes of 2.7·10⁸ FLOPs in 0.06 s). At 10⁹ FLOPs a pass takes one
#: core ≥ 35 ms against ~1–2 ms of launches on a GPU (≥ 10× on the bounds, so ≥ 5× left after the run's fixed
#: costs); below, the nets of the first GPU runs (ACAS Xu 1.3·10⁶, mnist_fc 1.4–2.7·10⁸) came out 0.07–1.4× the
#: CPU's time on an H200 (docs/benchmarks.md, "GPU"). Conv nets are far above (verivital 4.9·10⁹,
#: cifar_biasfield 3.7·10¹¹).
AUTO_CUDA_FLOPS = 1e9


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


def bound_pass_flops(graph: BoundGraph) -> float:
    """The FLOPs of one CROWN pass from the widest bounded node (its neurons as the pass's rows): the matrix
    products and convolutions of a forward pass at one point (counted by torch's ``FlopCounterMode``) times that
    node's size. What decides whether a GPU's throughput outweighs its launch latency (:data:`AUTO_CUDA_FLOPS`).

    Example::

        bound_pass_flops(load_onnx("mnist-net_256x6.onnx"))   # 2.7e8: stays on the CPU under --device auto
    """
    point = torch.zeros(1, *graph.input.shape, dtype=graph.dtype, device=graph.device)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        graph(point)
    widest = max((node.size for node in graph.nodes if node.name in graph.bounded), default=graph.output.size)
    return float(counter.get_total_flops() * widest)


def resolve_device(name: str, local_rank: int | None = None, graph: BoundGraph | None = None) -> torch.device:
    """The device for ``name`` on the rank with ``local_rank`` (default: ``$LOCAL_RANK``, else 0).

    ``auto`` is ``cuda`` where CUDA is available and ``graph`` (where given) is big enough for a GPU to win, one
    bound pass of at least :data:`AUTO_CUDA_FLOPS`, else ``cpu``; ``cuda`` is GPU ``local_rank % device_count``
    (each rank of a node on its own GPU, ranks sharing GPUs round-robin where there are fewer); ``cuda:N`` is GPU N.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if not isinstance(name, str):
        raise ValueError(f"a device is named by a string (cpu, cuda, cuda:N or auto), got {name!r}")
    if name == "auto":
        # the FLOPs are counted only where there is a GPU to choose (a forward pass under FlopCounterMode)
        big = torch.cuda.is_available() and (graph is None or bound_pass_flops(graph) >= AUTO_CUDA_FLOPS)
        name = "cuda" if big else "cpu"
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
