"""Learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["warmup_cosine"]


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak learning rate at each optimizer step, for ``torch.optim.lr_scheduler.LambdaLR``.

    Rises linearly over ``warmup_steps`` (reaching 1 at the last warm-up step), then follows half a cosine
    from 1 down to ``min_ratio`` at ``total_steps`` and stays there.

    Example::

        scheduler = LambdaLR(optimizer, warmup_cosine(total_steps=1000, warmup_steps=100, min_ratio=0.1))
    """
    if total_steps < 1 or not 0 <= warmup_steps <= total_steps or not 0.0 <= min_ratio <= 1.0:
        raise ValueError(
            f"warmup_cosine: need total_steps ≥ 1, 0 ≤ warmup_steps ≤ total_steps and 0 ≤ min_ratio ≤ 1; got"
            f" total_steps={total_steps}, warmup_steps={warmup_steps}, min_ratio={min_ratio}."
        )

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier
