"""What a codec could reach at a given payload rate, as references for the gradient zoo (research note §5).

Both model a flat vector as independent zero-mean Gaussians with one variance per group of 32 coordinates
(the group's mean square) and are given the rate for free of side information:

- ``gaussian_rd_bound``: the rate-distortion bound of that model, reverse water-filling over the groups'
  variances: no scheme of any block length does better on that source.
- ``scalar_oracle``: the best fixed-rate *scalar* code of that model: each group gets an integer width
  (0..8 bits) and the Lloyd-Max quantiser of N(0, σ²) at that width; widths are allocated optimally.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

__all__ = ["gaussian_rd_bound", "lloyd_max_distortion", "scalar_oracle"]

GROUP = 32
MAX_WIDTH = 8


@functools.cache
def lloyd_max_distortion(bits: int, iterations: int = 4000) -> float:
    """MSE of the Lloyd-Max (optimal fixed-rate scalar) quantiser of N(0, 1) with ``2^bits`` levels
    (0.3634, 0.1175, 0.03455, 0.009501 for 1–4 bits); 1.0 for 0 bits."""
    if bits == 0:
        return 1.0
    levels = 2**bits
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    # start from the high-rate optimum (levels at quantiles of the density^(1/3), for N(0, 1) that of N(0, 3)):
    # Lloyd's iteration converges slowly from plain quantiles at 7-8 bits
    centres = math.sqrt(3) * normal.icdf((torch.arange(levels, dtype=torch.float64) + 0.5) / levels)
    for _ in range(iterations):
        edges = torch.cat(
            [centres.new_tensor([-math.inf]), (centres[1:] + centres[:-1]) / 2, centres.new_tensor([math.inf])]
        )
        mass = normal.cdf(edges[1:]) - normal.cdf(edges[:-1])
        density = normal.log_prob(edges).exp()
        centres = (density[:-1] - density[1:]) / mass  # E[X | edge_k < X < edge_k+1]
    edges = torch.cat(
        [centres.new_tensor([-math.inf]), (centres[1:] + centres[:-1]) / 2, centres.new_tensor([math.inf])]
    )
    mass = normal.cdf(edges[1:]) - normal.cdf(edges[:-1])
    return float(1.0 - (mass * centres.square()).sum())  # E[X²] - E[centre²] for centroid levels


def _group_variances(x: Tensor) -> Tensor:
    x = x.reshape(-1).double()
    return x[: x.numel() // GROUP * GROUP].view(-1, GROUP).square().mean(dim=1)


def gaussian_rd_bound(x: Tensor, rate: float) -> float:
    """vNMSE of the rate-distortion bound at ``rate`` bits per coordinate for the per-group Gaussian model."""
    variances = _group_variances(x)
    total = float(variances.sum())

    def rate_at(level: float) -> float:
        return float(0.5 * torch.log2(variances / level).clamp(min=0).mean())

    low, high = math.log(float(variances[variances > 0].min()) * 1e-12), math.log(float(variances.max()))
    for _ in range(200):  # bisection on log(level); the rate falls as the water level rises
        middle = (low + high) / 2
        low, high = (middle, high) if rate_at(math.exp(middle)) > rate else (low, middle)
    level = math.exp(high)
    return float(torch.minimum(variances, torch.tensor(level, dtype=torch.float64)).sum()) / total


def scalar_oracle(x: Tensor, rate: float) -> float:
    """vNMSE of the best allocation of integer widths (mean width ``rate``) with Lloyd-Max levels per group.

    The distortion per width falls convexly, so the marginal gains ``σ²·(D_w - D_{w+1})`` of each group
    shrink with ``w`` and the optimum takes the largest ``rate · groups`` gains over all groups."""
    variances = _group_variances(x)
    distortion = torch.tensor([lloyd_max_distortion(b) for b in range(MAX_WIDTH + 1)], dtype=torch.float64)
    gains = variances[:, None] * (distortion[:-1] - distortion[1:])  # [G, 8]: the step from width w to w + 1
    units = min(round(rate * variances.numel()), gains.numel())
    taken = torch.topk(gains.reshape(-1), units).values.sum() if units else torch.tensor(0.0, dtype=torch.float64)
    total = float(variances.sum())
    return (total - float(taken)) / total
