"""What to do with a group older than ``max_staleness`` policy versions at consumption.

Staleness of a sample = trainer's policy version when it is consumed minus the version of its
oldest token. One small class per policy, selected by ``_target_`` (``rollout.staleness``).

* ``Drop``: discard it (TRL / verl style); costs the generation it took.
* ``Downweight``: train on it with weight ``gamma ** (staleness - max_staleness)``.
* ``Recompute``: anchor its PPO ratio at the current policy (pi_old computed once per rollout
  batch before its first optimizer step, ``GRPOModule.prepare_rollout_batch``; mu is kept).
  The ratio then starts at 1, so the update is clipped around the current policy rather than
  the stale one; it does **not** correct the state distribution (the tokens are still samples
  of the old policy), so the gradient stays biased. Bypass mode only: with
  ``algo.loss.anchor=decoupled`` every sample is already anchored so (rejected at start-up).
* ``Admit``: AReaL-style admission control: never start a group that could not be consumed
  within ``max_staleness`` versions, and make the trainer wait for groups that are due, so
  nothing is ever too stale and nothing is dropped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from data.rollout.experience import Experience
from modules.config_errors import check


class StalenessPolicy(ABC):
    admission_control = False
    drops = False

    @abstractmethod
    def apply(self, group: list[Experience], excess: int) -> list[Experience] | None:
        """``excess`` = staleness - max_staleness (> 0). Return the group to train, or None."""


class Drop(StalenessPolicy):
    drops = True

    def apply(self, group: list[Experience], excess: int) -> list[Experience] | None:
        return None


class Downweight(StalenessPolicy):
    def __init__(self, gamma: float = 0.5) -> None:
        check("rollout.staleness.gamma", gamma, 0 <= gamma <= 1, "a float in [0, 1]")
        self.gamma = gamma

    def apply(self, group: list[Experience], excess: int) -> list[Experience] | None:
        for e in group:
            e.weight *= self.gamma**excess
        return group


class Recompute(StalenessPolicy):
    def apply(self, group: list[Experience], excess: int) -> list[Experience] | None:
        for e in group:
            e.recompute = True
        return group


class Admit(StalenessPolicy):
    admission_control = True

    def apply(self, group: list[Experience], excess: int) -> list[Experience] | None:
        # Cannot happen when the controller enforces admission; keep the data if it does.
        return group
