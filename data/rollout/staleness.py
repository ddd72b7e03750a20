"""What to do with a group older than ``max_staleness`` policy versions at consumption.

Staleness of a sample = trainer's policy version when it is consumed minus the version of its
oldest token. One small class per policy, selected by ``_target_`` (``rollout.staleness``).

* ``Drop``: discard it (TRL / verl style); costs the generation it took.
* ``Downweight``: train on it with weight ``gamma ** (staleness - max_staleness)``.
* ``Recompute``: anchor its PPO ratio at the current policy (pi_old computed once per rollout
  batch before its first optimizer step, ``PolicyGradientModule.prepare_rollout_batch``; mu is kept).
  The ratio then starts at 1, so the update is clipped around the current policy rather than
  the stale one; it does **not** correct the state distribution (the tokens are still samples
  of the old policy), so the gradient stays biased. Bypass mode only: with
  ``algo.loss.anchor=decoupled`` every sample is already anchored so (rejected at start-up).
* ``Admit``: strict admission control: never start a group that could not be consumed
  within ``max_staleness`` versions, and make the trainer wait for groups that are due, so
  nothing is ever too stale and nothing is dropped. The wait is a barrier on the slowest
  group of each version: on a long-tailed workload the trainer idles behind it.
* ``Throttle``: the issue-side half of ``Admit`` alone, as AReaL runs it: a group starts only
  while what is outstanding could be trained within ``max_staleness`` versions, the trainer
  takes its batch by the selection rule (FIFO: the first complete groups) and never waits for
  due ones, and nothing is dropped. Generation never runs more than K versions ahead of the
  trainer, so most groups are trained within K; one that generates for longer than K
  versions is trained at its staleness (the correction sees it; ``rollout/over_bound`` counts
  them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from data.rollout.experience import Experience
from modules.launch.config_errors import check


class StalenessPolicy(ABC):
    admission_control = False  # the trainer waits for groups that are due (Admit)
    throttles = False  # no group starts that could not be trained within K versions
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
    throttles = True

    def apply(self, group: list[Experience], excess: int) -> list[Experience] | None:
        # Cannot happen when the controller enforces admission; keep the data if it does.
        return group


class Throttle(StalenessPolicy):
    throttles = True

    def apply(self, group: list[Experience], excess: int) -> list[Experience] | None:
        return group  # trained at its staleness; the correction sees it
