"""The zoo's references against published values: Lloyd-Max distortions of N(0, 1) (Max 1960), the Gaussian
rate-distortion function 2^(-2R), and the ring allocation bound's closed forms."""

from __future__ import annotations

import pytest
import torch

from lightning_fedshard.bench.compression import ring_allocation_bound
from lightning_fedshard.bench.rate_distortion import gaussian_rd_bound, lloyd_max_distortion, scalar_oracle


@pytest.mark.parametrize("bits,published", [(1, 0.3634), (2, 0.1175), (3, 0.03455), (4, 0.009501), (5, 0.002505)])
def test_lloyd_max_distortions_are_the_published_ones(bits, published) -> None:
    assert lloyd_max_distortion(bits) == pytest.approx(published, rel=2e-3)


def test_on_iid_gaussians_the_references_are_the_textbook_curves() -> None:
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0))
    assert gaussian_rd_bound(x, 3.0) == pytest.approx(2.0**-6, rel=0.05)
    # equal variances: every group gets the same width, so the oracle is the Lloyd-Max distortion at it
    assert scalar_oracle(x, 3.0) == pytest.approx(0.03455, rel=0.05)


def test_ring_allocation_bound_closed_forms() -> None:
    gen = torch.Generator().manual_seed(0)
    independent = [torch.randn(1 << 16, generator=gen) for _ in range(8)]
    assert ring_allocation_bound(independent) == pytest.approx(3.44, abs=0.03)
    assert ring_allocation_bound([independent[0]] * 8) == pytest.approx(2.2357, abs=1e-3)
