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

Each policy owns its decisions: may a group start (``may_start``), the batch rule
(``selection``), what leaves untrained before a batch (``retire``, carried out by
``retirement.py``), does the trainer wait (``waits``), what the batch takes first (``first``),
how a group past K is trained (``apply``). Controllers branch on no policy; K moves at run time
in one place, ``StalenessBound.set_max_staleness``, which tells the controller to resize.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from data.rollout.experience import Experience
from data.rollout.retirement import Retirement
from data.rollout.selection import Admission, BatchSelection, Fifo, Ready
from modules.config.errors import check


def recompute_needs_bypass_anchor(cfg: Any) -> None:
    """Cross-field rule of ``Recompute``: it re-anchors a stale group's ratio at the current
    policy, which the decoupled anchor already does for every sample."""
    allowed = "drop, downweight, admit, throttle or regenerate with algo.loss.anchor=decoupled (decoupled "
    allowed += "PPO already anchors every sample at the current policy: Recompute would change nothing)"
    check("rollout.staleness", "Recompute", cfg.algo.loss.get("anchor") != "decoupled", allowed)


class StalenessPolicy(ABC):
    """What happens to groups against the bound K. The defaults: every group may start, the
    configured batch rule, nothing retired or waited for, and a group past K goes to ``apply``."""

    # Rules relating this policy to other config groups (``modules/launch/validate.py`` runs them).
    cross_field_rules: ClassVar[tuple[Callable[[Any], None], ...]] = ()

    @abstractmethod
    def apply(self, group: list[Experience], excess: int) -> list[Experience] | None:
        """``excess`` = staleness - max_staleness (> 0). Return the group to train, or None."""

    def holds_bound(self) -> bool:
        """No group is ever trained past a finite bound."""
        return False

    def may_start(self, bound: StalenessBound, outstanding: float, version: int) -> bool:
        return True

    def counts_versions(self) -> bool:
        """Group starts are counted against batches per policy version."""
        return False

    def selection(self, configured: BatchSelection | None) -> BatchSelection:
        return configured or Fifo()

    def check_advantage(self, advantage: Any) -> None:
        """Raise ``ConfigError`` if this policy cannot use ``advantage`` (start-up check)."""
        return None  # every estimator: only admit and regenerate count whole groups

    def discards_past_bound(self) -> bool:
        """A group past the bound leaves untrained (dropped or regenerated) before the batch."""
        return False

    def retire(self, bound: StalenessBound, ctl: Retirement, version: int) -> None:
        """Take out what may no longer be trained, before a batch is chosen."""
        return None  # nothing: a group past the bound goes to ``apply``

    def waits(self, bound: StalenessBound, ctl: Retirement, version: int) -> bool:
        """The trainer waits for a group still generating rather than take a batch now."""
        return False

    def first(self, bound: StalenessBound, ctl: Retirement, chosen: list[Ready], version: int) -> list[Ready]:
        """The batch, with the groups this policy must train now put in first."""
        return chosen


class Drop(StalenessPolicy):
    def apply(self, group: list[Experience], excess: int) -> list[Experience] | None:
        return None

    def holds_bound(self) -> bool:
        return True

    def discards_past_bound(self) -> bool:
        return True

    def retire(self, bound: StalenessBound, ctl: Retirement, version: int) -> None:
        """Discard a buffered group past the bound; with ``rollout.cancel_doomed``, cancel a
        generating one it would discard on arrival."""
        if ctl.cancel_doomed:
            ctl.drop_generating({gid for gid, _, start in ctl.generating() if bound.doomed(version, start)})
        for r in [r for r in ctl.buffered() if bound.too_stale(version, r.start_version)]:
            ctl.drop_buffered(r)


class Downweight(StalenessPolicy):
    def __init__(self, gamma: float = 0.5) -> None:
        check("rollout.staleness.gamma", gamma, 0 <= gamma <= 1, "a float in [0, 1]")
        self.gamma = gamma

    def apply(self, group: list[Experience], excess: int) -> list[Experience] | None:
        for e in group:
            e.weight *= self.gamma**excess
        return group


class Recompute(StalenessPolicy):
    cross_field_rules = (recompute_needs_bypass_anchor,)

    def apply(self, group: list[Experience], excess: int) -> list[Experience] | None:
        for e in group:
            e.recompute = True
        return group


class Throttled(StalenessPolicy):
    """The issue side of admission control: a group starts only while what is outstanding could
    be trained within K versions (``StalenessBound.may_start``)."""

    def may_start(self, bound: StalenessBound, outstanding: float, version: int) -> bool:
        k = bound.max_staleness
        if k is None:
            return True
        slots = (k + 1) * bound.batches_per_version - bound.taken(version)
        return outstanding < slots * bound.prompts_per_step

    def counts_versions(self) -> bool:
        return True


def refuse_per_response(advantage: Any, name: str) -> None:
    allowed = f"a group-wise estimator (algo/advantage=group) with rollout/staleness={name} (it counts "
    allowed += "and regenerates whole groups)"
    check("algo.advantage", type(advantage).__name__, not advantage.per_response, allowed)


class Admit(Throttled):
    """Strict admission control: the batch rule (``selection.Admission``) takes a batch only
    when every outstanding group stays trainable within K, so nothing is ever past it."""

    def apply(self, group: list[Experience], excess: int) -> list[Experience] | None:
        # Cannot happen when the controller enforces admission; keep the data if it does.
        return group

    def holds_bound(self) -> bool:
        return True

    def selection(self, configured: BatchSelection | None) -> BatchSelection:
        ok = configured is None or isinstance(configured, Fifo)
        allowed = "fifo with rollout.staleness=Admit (admission control chooses the batch itself)"
        check("rollout.selection", type(configured).__name__, ok, allowed)
        return Admission()

    def check_advantage(self, advantage: Any) -> None:
        refuse_per_response(advantage, "admit")


class Throttle(Throttled):
    def apply(self, group: list[Experience], excess: int) -> list[Experience] | None:
        return group  # trained at its staleness; the correction sees it


class Regenerate(Throttled):
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

    def holds_bound(self) -> bool:
        return True

    def discards_past_bound(self) -> bool:
        return True

    def check_advantage(self, advantage: Any) -> None:
        refuse_per_response(advantage, "regenerate")

    def protected(self, ctl: Retirement, row: dict) -> bool:
        """Regenerated ``max_regenerations`` times already: waited for, not regenerated."""
        return ctl.regenerations(row) >= self.max_regenerations

    def retire(self, bound: StalenessBound, ctl: Retirement, version: int) -> None:
        """Cancel the generating groups past the bound on arrival and regenerate their prompts,
        and regenerate the buffered ones past it."""
        ctl.regenerate_generating({gid for gid, _, start in ctl.generating() if bound.doomed(version, start)})
        for r in [r for r in ctl.buffered() if bound.too_stale(version, r.start_version)]:
            ctl.regenerate_buffered(r)

    def waits(self, bound: StalenessBound, ctl: Retirement, version: int) -> bool:
        """A protected group still generating is due (the batch taken now must hold it) and the
        batch has a place for it. More protected groups due at once than a batch holds (rare:
        each was regenerated already) are regenerated again rather than waited for."""
        due_buffered = sum(
            self.protected(ctl, ctl.row_of(r)) and bound.due(version, r.start_version) for r in ctl.buffered()
        )
        if due_buffered >= ctl.batch_units:
            return False
        return any(
            self.protected(ctl, row) and bound.due(version, start) for _, row, start in ctl.generating()
        )

    def first(self, bound: StalenessBound, ctl: Retirement, chosen: list[Ready], version: int) -> list[Ready]:
        """Every buffered group that must be in this batch to stay within the bound is ranked
        (protected first, then oldest); the first of them take the batch's places and the
        selection rule's other picks fill the rest (so under ``stratified`` a due group may take
        another level's place: the bound comes first)."""
        due = [r for r in ctl.buffered() if bound.due(version, r.start_version)]
        if not due:
            return chosen
        due.sort(key=lambda r: (not self.protected(ctl, ctl.row_of(r)), r.start_version, r.completed_at))
        due = due[: len(chosen)]
        return due + [r for r in chosen if r not in due][: len(chosen) - len(due)]


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
        self._check(max_staleness)
        self.max_staleness = max_staleness
        self._listeners: list[Callable[[], None]] = []
        self.policy = policy
        self.prompts_per_step = prompts_per_step
        self.batches_per_version = batches_per_version
        self.taken_at = -1  # version at which the last batch was taken
        self.taken_count = 0  # batches taken at that version

    def set_max_staleness(self, value: int | None) -> None:
        """The one way to move K at run time (``modules.callbacks.drift_controller``): the
        controller that listens (``on_change``) resizes what may be outstanding."""
        self._check(value)
        self.max_staleness = value
        for listener in self._listeners:
            listener()

    def on_change(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def check_sync_every_s(self, value: float | None) -> None:
        allowed = (
            "null with rollout/staleness=admit, throttle or regenerate (they count batches per version; "
            "partial rollout's default is regenerate): or choose rollout/staleness=drop"
        )
        check("data.sync_every_s", value, value is None or not self.policy.counts_versions(), allowed)

    @staticmethod
    def _check(k: int | None) -> None:
        ok = k is None or (isinstance(k, int) and not isinstance(k, bool) and k >= 0)
        check("rollout.max_staleness", k, ok, "null (unbounded) or an int >= 0 (policy versions)")

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
        return self.policy.may_start(self, outstanding, version)

    def too_stale(self, version: int, start_version: int) -> bool:
        """A dropping (regenerating) policy discards (regenerates) a buffered group past the bound."""
        return self.policy.discards_past_bound() and self.excess(version, start_version) > 0

    def doomed(self, version: int, start_version: int) -> bool:
        """A group still generating that a dropping (regenerating) policy will discard
        (regenerate) on arrival: its submission is more than K + 1 versions old (a request
        starts at or after it)."""
        if self.max_staleness is None or not self.policy.discards_past_bound():
            return False
        return version - start_version > self.max_staleness + 1

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
        return exps if excess == 0 else self.policy.apply(exps, excess)

    def over_bound(self, version: int, start_version: int) -> bool:
        """A group taken now is trained past the bound (counted in ``rollout/over_bound``)."""
        return self.excess(version, start_version) > 0 and not self.policy.holds_bound()

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
