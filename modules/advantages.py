"""Group-relative advantages (GRPO), computed once a group's G rewards are all in.

    A_i = (r_i - mean(r)) / (std(r) + eps)       GRPO (scale_by_std=True)
    A_i =  r_i - mean(r)                         Dr.GRPO (scale_by_std=False)

std is the population std (divide by G): with G=2 and rewards {0,1} this gives +-1 (up to
eps). A group whose rewards are all equal gets advantage 0 for every member (no NaN): it
carries no learning signal and only adds tokens to the denominator of a token-mean loss.
"""

from __future__ import annotations

import torch

from modules.config_errors import check


def group_advantages(rewards: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """``rewards [num_groups, G]`` -> advantages of the same shape."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centered
    std = rewards.std(dim=1, unbiased=False, keepdim=True)
    return centered / (std + eps)


class GroupAdvantage:
    """Config-selectable wrapper: ``algo.advantage`` in the config."""

    def __init__(self, scale_by_std: bool = True, eps: float = 1e-6) -> None:
        check(
            "algo.advantage.eps",
            eps,
            eps > 0 or not scale_by_std,
            "a float > 0 when scale_by_std (equal rewards would give 0/0)",
        )
        self.scale_by_std = scale_by_std
        self.eps = eps

    def __call__(self, rewards: list[float]) -> list[float]:
        """Advantages of one complete group."""
        adv = group_advantages(torch.tensor([rewards], dtype=torch.float64), self.scale_by_std, self.eps)
        return adv[0].tolist()
