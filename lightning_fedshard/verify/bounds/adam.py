"""Adam for the bound optimisers' parameters (α slopes, β multipliers), without ``torch.optim``.

``torch.optim.Adam`` imports ``torch._dynamo`` on its first step, 2–9 s on a loaded CPU, and that time counts inside
a verification's timeout. The bound optimisers need none of its options: the update here is Adam's
(``torch.optim.Adam`` with its defaults, minimising), operation for operation, over groups of parameters with their
own learning rates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["Adam"]


class Adam:
    """Adam over ``groups``: each a list of parameters and its learning rate. A parameter without a gradient at
    :meth:`step` is left as it is, its moments and step count too (as in ``torch.optim.Adam``).

    Example::

        adam = Adam([(list(alphas.values()), 0.1), (list(betas.values()), 0.05)])
        loss.backward(); adam.step(); adam.zero_grad(); adam.scale_lr(0.98)
    """

    def __init__(
        self,
        groups: Sequence[tuple[Sequence[Tensor], float]],
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        for params, lr in groups:
            if not lr >= 0:
                raise ValueError(f"a learning rate must be ≥ 0, got {lr}")
            if any(not p.requires_grad for p in params):
                raise ValueError("every parameter Adam updates must require grad")
        self.lrs = [float(lr) for _, lr in groups]
        self.groups = [list(params) for params, _ in groups]
        self.betas, self.eps = betas, eps
        self._state: dict[int, tuple[int, Tensor, Tensor]] = {}

    def zero_grad(self) -> None:
        """Drop every parameter's gradient (``set_to_none``)."""
        for params in self.groups:
            for p in params:
                p.grad = None

    def scale_lr(self, factor: float) -> None:
        """Multiply every group's learning rate by ``factor`` (an exponential decay step)."""
        self.lrs = [lr * factor for lr in self.lrs]

    @torch.no_grad()
    def step(self) -> None:
        """One Adam step on every parameter with a gradient."""
        beta1, beta2 = self.betas
        for params, lr in zip(self.groups, self.lrs, strict=True):
            for p in params:
                if p.grad is None:
                    continue
                count, mean, square = self._state.get(id(p)) or (0, torch.zeros_like(p), torch.zeros_like(p))
                count += 1
                mean.lerp_(p.grad, 1 - beta1)
                square.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                step_size = lr / (1 - beta1**count)
                denom = (square.sqrt() / math.sqrt(1 - beta2**count)).add_(self.eps)
                p.addcdiv_(mean, denom, value=-step_size)
                self._state[id(p)] = (count, mean, square)
