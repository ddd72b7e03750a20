"""Learning-rate schedules as plain factories (selected by ``_target_`` in ``conf/module``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


def optimizers(params: Iterable[torch.nn.Parameter], optimizer: Callable, scheduler: Callable | None) -> Any:
    """What ``configure_optimizers`` returns: the optimizer, and a per-step schedule if given."""
    opt = optimizer(params=params)
    if scheduler is None:
        return opt
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler(optimizer=opt), "interval": "step"}}


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to the base rate, then cosine decay to ``min_ratio`` of it."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
