"""Staleness, in one place: may a group start, may it be trained now, with what weight, and how
many groups may be outstanding, for every rollout mode and staleness policy.

Staleness of a sample = trainer's policy version when it is consumed minus the version of its
oldest token. ``StalenessBound`` (below) owns the bound K (``rollout.max_staleness``; None =
unbounded, partial rollout's default; the sync barrier has nothing stale), the policy and the
count of batches taken at the current version, and answers every staleness question the
controllers, the selection rule and the sizing ask. What happens to a group past the bound is
one small class per policy, selected by ``_target_`` (``rollout/staleness=<name>``):

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
  them). Its ``max_staleness`` is a target, not a bound.
* ``Regenerate``: ``Throttle``'s issue side, and the bound holds: a group that can no longer
  be trained within K versions is not trained; its prompt goes back to the front of the
  stream and is generated again with the current weights (nothing is dropped; the generation
  it took is spent, counted in ``rollout/regenerated``). The batch takes groups about to pass
  the bound first, and a prompt already regenerated ``max_regenerations`` times is waited for
  when due (a barrier on that group alone), so a prompt too long for the bound is still
  trained, within it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from data.rollout.experience import Experience
from modules.config.errors import check


class StalenessPolicy(ABC):
    admission_control = False  # the trainer waits for groups that are due (Admit)
    throttles = False  # no group starts that could not be trained within K versions
    drops = False
    regenerates = False  # a group past the bound is generated again from its prompt
    # re-anchoring the ratio at the current policy means nothing under the decoupled anchor
    needs_bypass_anchor = False

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
    needs_bypass_anchor = True

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


class Regenerate(StalenessPolicy):
    throttles = True
    regenerates = True

    def __init__(self, max_regenerations: int = 1) -> None:
        check(
            "rollout.staleness.max_regenerations",
            max_regenerations,
            isinstance(max_regenerations, int)
            and not isinstance(max_regenerations, bool)
            and max_regenerations >= 0,
            "an int >= 0 (times a prompt is regenerated before the trainer waits for it when due)",
        )
        self.max_regenerations = max_regenerations

    def apply(self, group: list[Experience], excess: int) -> list[Experience] | None:
        raise RuntimeError(
            "a group past rollout.max_staleness reached the batch under Regenerate: the "
            "controller regenerates such groups before it chooses a batch"
        )


def trainable_groups(
    prompts_per_step: int, batches_per_version: int, max_staleness: int | None
) -> int | None:
    """Groups that can still be trained within the bound when started now: the K + 1 versions
    from this one train ``(K + 1) x batches_per_version`` batches of P groups (None: unbounded)."""
    if max_staleness is None:
        return None
    return prompts_per_step * batches_per_version * (max_staleness + 1)


class StalenessBound:
    """The one object every mode asks about staleness (``rollout.max_staleness`` + ``rollout.staleness``).

    * ``may_start``: may one more group start generating (``throttle`` / ``admit`` count what is
      outstanding against the batches the next K + 1 versions train)?
    * ``admit``: a group chosen for the batch, past the bound or not: the experiences to train
      (with the policy's weight or recompute flag), or None (dropped).
    * ``too_stale`` / ``doomed``: what ``drop`` discards from the buffer / cancels while generating.
    * ``leaves_room``: admission control's check that taking a batch leaves every outstanding
      group trainable within K.
    * ``trainable_groups``: how many groups may be outstanding at all (the sizing's ceiling).
    """

    def __init__(
        self,
        max_staleness: int | None,
        policy: StalenessPolicy,
        prompts_per_step: int,
        batches_per_version: int = 1,
    ) -> None:
        check(
            "rollout.max_staleness",
            max_staleness,
            max_staleness is None
            or (
                isinstance(max_staleness, int) and not isinstance(max_staleness, bool) and max_staleness >= 0
            ),
            "null (unbounded) or an int >= 0 (policy versions)",
        )
        self.max_staleness = max_staleness
        self.policy = policy
        self.prompts_per_step = prompts_per_step
        self.batches_per_version = batches_per_version
        self.taken_at = -1  # version at which the last batch was taken
        self.taken_count = 0  # batches taken at that version

    # ------------------------------------------------------------------ what the policy is
    @property
    def waits_for_due(self) -> bool:
        """The trainer waits for groups that are due (strict admission control, ``admit``)."""
        return self.policy.admission_control

    @property
    def counts_versions(self) -> bool:
        """The policy counts batches per policy version (``throttle``, ``admit``), bounded or not."""
        return self.policy.throttles

    @property
    def throttles(self) -> bool:
        return self.policy.throttles and self.max_staleness is not None

    @property
    def drops(self) -> bool:
        return self.policy.drops and self.max_staleness is not None

    @property
    def regenerates(self) -> bool:
        return self.policy.regenerates and self.max_staleness is not None

    @property
    def holds(self) -> bool:
        """No group is ever trained past the bound (``drop``, ``admit``, ``regenerate``)."""
        return self.max_staleness is not None and (self.drops or self.waits_for_due or self.regenerates)

    # ------------------------------------------------------------------ counting versions
    def taken(self, version: int) -> int:
        """Batches already taken at ``version``."""
        return self.taken_count if self.taken_at == version else 0

    def record_take(self, version: int) -> None:
        self.taken_count = self.taken(version) + 1
        self.taken_at = version

    def trainable_groups(self) -> int | None:
        return trainable_groups(self.prompts_per_step, self.batches_per_version, self.max_staleness)

    # ------------------------------------------------------------------ the questions
    def excess(self, version: int, start_version: int) -> int:
        """Versions past the bound (0 within it, or with no bound)."""
        if self.max_staleness is None:
            return 0
        return max(version - start_version - self.max_staleness, 0)

    def may_start(self, outstanding: float, version: int) -> bool:
        """A group started now (version v) must be trained by v + K: at most
        ``((K + 1) x batches_per_version - taken) x P`` groups may be outstanding."""
        if not self.throttles:
            return True
        slots = (self.max_staleness + 1) * self.batches_per_version - self.taken(version)
        return outstanding < slots * self.prompts_per_step

    def too_stale(self, version: int, start_version: int) -> bool:
        """A dropping (regenerating) policy discards (regenerates) a buffered group past the bound."""
        return (self.drops or self.regenerates) and self.excess(version, start_version) > 0

    def doomed(self, version: int, start_version: int) -> bool:
        """A group still generating that a dropping (regenerating) policy will discard
        (regenerate) on arrival: its submission is more than K + 1 versions old (a request
        starts at or after it)."""
        return (self.drops or self.regenerates) and version - start_version > self.max_staleness + 1

    def due(self, version: int, start_version: int) -> bool:
        """A group that must be in the batch taken now to stay within the bound: this batch is
        the version's last, and at the next version the group would be past K."""
        if self.max_staleness is None or self.taken(version) + 1 < self.batches_per_version:
            return False
        return version + 1 - start_version > self.max_staleness

    def admit(self, exps: list[Experience], version: int, start_version: int) -> list[Experience] | None:
        """The group's experiences to train (weighted or flagged by the policy past the bound),
        or None when the policy drops it."""
        excess = self.excess(version, start_version)
        if excess == 0 or self.waits_for_due:
            return exps
        return self.policy.apply(exps, excess)

    def leaves_room(self, left: Iterable[int], version: int) -> bool:
        """Admission control: after this batch, can every group still outstanding (start
        versions ``left``) be trained within K? Counts, for each start version u, the groups
        started at or before u against the batches left through version u + K."""
        if self.max_staleness is None:
            return True  # unbounded: every group is trainable whenever it is taken
        left = list(left)
        k, p, bpv = self.max_staleness, self.prompts_per_step, self.batches_per_version
        taken = self.taken(version)
        return all(
            sum(s <= u for s in left) <= ((u + k - version + 1) * bpv - taken - 1) * p for u in set(left)
        )

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"taken": [self.taken_at, self.taken_count]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.taken_at, self.taken_count = (int(x) for x in state.get("taken", (-1, 0)))
