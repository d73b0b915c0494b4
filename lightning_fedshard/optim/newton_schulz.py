"""Quintic Newton–Schulz iteration: the orthogonalisation Muon applies to a momentum matrix."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["NS_COEFFICIENTS", "newton_schulz", "ns_dtype"]

#: Keller Jordan's quintic coefficients (also torch.optim.Muon's): the slope at zero is maximised, so five
#: iterations bring every singular value into roughly [0.7, 1.2] instead of converging exactly to 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on accelerators (the matmuls run on tensor cores, as in torchtitan and Moonshot); fp32 on CPU, where
    bf16 matmuls are emulated and slower."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def newton_schulz(
    matrix: Tensor, steps: int = 5, dtype: torch.dtype | None = None, eps: float = 1e-7
) -> Tensor:
    """Approximately ``U Vᵀ`` of ``matrix = U S Vᵀ``: ``steps`` quintic iterations ``X ← aX + (bA + cA²)X``
    with ``A = XXᵀ`` on the wide orientation of ``matrix`` scaled to unit Frobenius norm.

    The same operations as ``torch.optim.Muon``'s, in ``dtype`` (default :func:`ns_dtype` of the device);
    the result comes back in ``matrix``'s dtype. Example::

        o = newton_schulz(torch.randn(64, 32))  # (64, 32), singular values near 1
    """
    if matrix.ndim != 2:
        raise ValueError(f"newton_schulz takes a 2-D matrix, got shape {tuple(matrix.shape)}.")
    if not isinstance(steps, int) or not 1 <= steps < 100:
        raise ValueError(f"newton_schulz: `steps` must be an integer in [1, 100), got {steps!r}.")
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype or ns_dtype(matrix.device))
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(matrix.dtype)
