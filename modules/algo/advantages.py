"""Advantage estimators, selected with ``algo/advantage=<name>`` (``conf/algo/advantage/``).

``group`` (GRPO), computed once a group's G rewards are all in:

    A_i = (r_i - mean(r)) / (std(r) + eps)       GRPO (scale_by_std=True)
    A_i =  r_i - mean(r)                         Dr.GRPO (scale_by_std=False)

std is the population std (divide by G): with G=2 and rewards {0,1} this gives +-1 (up to
eps). A group whose rewards are all equal gets advantage 0 for every member (no NaN): it
carries no learning signal and only adds tokens to the denominator of a token-mean loss.
"""

from __future__ import annotations

from typing import Any

import torch

from modules.config.errors import check, check_choice


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
    """GRPO's group-normalised advantage (``algo/advantage=group``, the default): a group's
    advantages are computed once all G of its rewards are in."""

    per_response = False

    def __init__(self, scale_by_std: bool = True, eps: float = 1e-6) -> None:
        check(
            "algo.advantage.eps",
            eps,
            eps > 0 or not scale_by_std,
            "a float > 0 when scale_by_std (equal rewards would give 0/0)",
        )
        self.scale_by_std = scale_by_std
        self.eps = eps

    def state_dict(self) -> dict:
        return {}  # stateless

    def load_state_dict(self, state: dict) -> None:
        pass

    def __call__(self, rewards: list[float]) -> list[float]:
        """Advantages of one complete group."""
        adv = group_advantages(torch.tensor([rewards], dtype=torch.float64), self.scale_by_std, self.eps)
        return adv[0].tolist()


class RunningBaseline:
    """Advantage ``r - b`` against a running baseline instead of the group mean.

    ``b`` is an exponential moving average of past rewards (``momentum``), over all prompts
    (``scope=global``) or per prompt id (``per_prompt``). A streaming controller then releases
    each response on its own as soon as it is scored (``per_response``), instead of waiting for
    its group's slowest member. This changes the estimator: ``b`` is not the group mean, it
    lags the policy, and per prompt it starts from the first reward seen (advantage 0 for it).
    Selected with ``algo/advantage=running`` (streaming rollout only).
    """

    per_response = True

    def __init__(self, scope: str = "global", momentum: float = 0.9) -> None:
        check_choice("algo.advantage.scope", scope, ("global", "per_prompt"))
        check("algo.advantage.momentum", momentum, 0 <= momentum < 1, "a float in [0, 1)")
        self.scope = scope
        self.momentum = momentum
        self._baselines: dict = {}

    def state_dict(self) -> dict:
        """The baselines, as [key, value] pairs (keys are prompt ids or "all")."""
        return {"baselines": [[k, v] for k, v in self._baselines.items()]}

    def load_state_dict(self, state: dict) -> None:
        self._baselines = {k: float(v) for k, v in state.get("baselines", [])}

    def single(self, reward: float, prompt_id: object) -> float:
        """Advantage of one response; updates the baseline."""
        key = "all" if self.scope == "global" else prompt_id
        b = self._baselines.get(key, reward)
        self._baselines[key] = self.momentum * b + (1 - self.momentum) * reward
        return float(reward - b)


def group_advantage_needs_groups(cfg: Any) -> None:
    """Cross-field rule: group advantages need two responses per prompt (one has advantage 0);
    with a critic (recipe=ppo) the advantages are the critic's, so one is fine."""
    from modules.config.schema import builds

    group_size = cfg.rollout.group_size  # < 1 is reported by the controller, naming ">= 1"
    if builds(cfg.algo.advantage, GroupAdvantage) and group_size >= 1 and cfg.module.get("critic") is None:
        check(
            "rollout.group_size",
            group_size,
            group_size >= 2,
            "an int >= 2 with group advantages (one response per prompt has advantage 0: "
            "nothing would be learned); for single responses use algo/advantage=running",
        )
