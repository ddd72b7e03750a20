"""Learning-rate schedules (selected by ``_target_`` in ``conf/module``): built at start-up (their
arguments are checked then), called with the optimizer in ``configure_optimizers``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from modules.config.errors import check


def optimizers(params: Iterable[torch.nn.Parameter], optimizer: Callable, scheduler: Callable | None) -> Any:
    """What ``configure_optimizers`` returns: the optimizer, and a per-step schedule if given."""
    opt = optimizer(params=params)
    if scheduler is None:
        return opt
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler(optimizer=opt), "interval": "step"}}


class WarmupCosine:
    """Linear warm-up to the base rate, then cosine decay to ``min_ratio`` of it, over
    ``total_steps`` optimizer steps (``module.scheduler``; called with the optimizer)."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> None:
        check(
            "module.scheduler.total_steps", total_steps, total_steps >= 1, "an int >= 1 (trainer.max_steps)"
        )
        # a warm-up longer than the run is allowed (a shortened test run keeps the recipe's)
        check(
            "module.scheduler.warmup_steps", warmup_steps, warmup_steps >= 0, "an int >= 0 (optimizer steps)"
        )
        check("module.scheduler.min_ratio", min_ratio, 0 <= min_ratio <= 1, "a float in [0, 1]")
        self.warmup_steps, self.total_steps, self.min_ratio = warmup_steps, total_steps, min_ratio

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / max(1, self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def __call__(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor)
