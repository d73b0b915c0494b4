"""The bound optimisers' Adam: the same steps as ``torch.optim.Adam`` (with ``ExponentialLR``), and an α/β-CROWN
optimisation that leaves ``torch._dynamo`` unimported (its import counted seconds inside a verification's timeout)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_fedshard.verify.bounds.adam import Adam

REPO = Path(__file__).resolve().parents[2]


def test_steps_equal_torch_adam_with_an_exponential_decay() -> None:
    gen = torch.Generator().manual_seed(0)
    alphas = [torch.rand(3, 4, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(2)]
    betas = [torch.rand(5, dtype=torch.float64, generator=gen).requires_grad_()]
    unused = torch.rand(2, dtype=torch.float64, generator=gen).requires_grad_()  # no gradient: never moves
    twins = [t.detach().clone().requires_grad_() for t in [*alphas, *betas, unused]]
    ours = Adam([([*alphas, unused], 0.1), (betas, 0.05)])
    reference = torch.optim.Adam([{"params": [*twins[:2], twins[3]], "lr": 0.1}, {"params": [twins[2]], "lr": 0.05}])
    decay = torch.optim.lr_scheduler.ExponentialLR(reference, 0.98)

    def loss(a: list[torch.Tensor], b: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        return -(torch.sin(a[0] * w) + a[1] ** 3).sum() + b[0].exp().sum()

    for _ in range(8):
        w = torch.randn(3, 4, dtype=torch.float64, generator=gen)
        ours.zero_grad()
        reference.zero_grad(set_to_none=True)
        loss(alphas, betas, w).backward()
        loss(twins[:2], twins[2:3], w).backward()
        ours.step()
        reference.step()
        ours.scale_lr(0.98)
        decay.step()
    for mine, theirs in zip([*alphas, *betas, unused], twins, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-14, atol=1e-14)


def test_a_negative_learning_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="learning rate"):
        Adam([([torch.zeros(1, requires_grad=True)], -0.1)])


def test_alpha_and_beta_crown_do_not_import_dynamo() -> None:
    script = textwrap.dedent(
        """
        import sys
        import torch
        from lightning_fedshard.verify.bab.domains import DomainBatch
        from lightning_fedshard.verify.bounds.alpha import alpha_crown
        from lightning_fedshard.verify.bounds.beta import beta_crown
        from lightning_fedshard.verify.objective import OutputSpec
        from lightning_fedshard.verify.ops import Interval
        from lightning_fedshard.verify.spec import Case, Disjunct, InputBox
        from tests.verify.nets import random_mlp
        import numpy as np

        graph = random_mlp(0, (2, 8, 8, 1))
        box = Interval(torch.full((1, 2), -1.0), torch.full((1, 2), 1.0))
        case = Case(InputBox(np.full(2, -1.0), np.full(2, 1.0)), [Disjunct(np.ones((1, 1)), np.array([-10.0]))])
        spec = OutputSpec.from_case(case, graph.output.shape, graph.dtype)
        root = alpha_crown(graph, box, spec.rows(1), iterations=3)
        assert root.iterations == 3, root.iterations
        beta_crown(graph, box, spec.rows(1), DomainBatch.at_root(graph, spec, root), iterations=3)
        assert "torch._dynamo" not in sys.modules, "an optimiser imported torch._dynamo"
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
