"""Which buffered groups make the next rollout batch (streaming and partial rollout).

One small class per rule, selected with ``rollout/selection=<name>`` (``conf/rollout/selection/``):

* ``Fifo`` (default): the first groups to complete, in completion order.
* ``Stratified``: against completion-time bias, each difficulty level gets a quota of the
  batch equal to its share of issued samples; the batch waits while a level is short of its
  quota and still has groups generating (a partial barrier on slow levels only).
* ``Admission``: used by the ``Admit`` staleness policy (AReaL-style admission control),
  not selected directly: oldest groups first, and only if every outstanding group can still
  be trained within ``max_staleness`` versions; otherwise wait for older groups.

A rule sees a ``BatchView`` (read-only state of the controller) and returns the chosen
groups, or None to wait for more completions.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from data.rollout.experience import Experience


@dataclass
class Ready:
    """A complete group (or, with a running baseline, one response) waiting in the buffer."""

    group_id: int
    exps: list[Experience]
    start_version: int  # version of its oldest token
    completed_at: float
    level: Any = None  # task difficulty bucket


@dataclass
class BatchView:
    buffer: Sequence[Ready]  # in completion order
    generating: list[tuple[Any, int]]  # (level, start version) of each group still generating
    version: int  # current policy version
    units: int  # buffer entries per batch: P groups (or P x G single responses)
    issued_levels: Counter  # samples issued per difficulty level so far
    prompts_per_step: int
    bound: Any  # staleness.StalenessBound: K, the batches taken at this version, the due rule


class BatchSelection(ABC):
    @abstractmethod
    def choose(self, view: BatchView) -> list[Ready] | None:
        """The entries of the next batch, or None to wait for more completions."""

    @staticmethod
    def fill(chosen: list[Ready], view: BatchView) -> list[Ready] | None:
        """Top ``chosen`` up to a full batch in completion order; None if the buffer is short."""
        for r in view.buffer:
            if len(chosen) >= view.units:
                break
            if r not in chosen:
                chosen.append(r)
        return chosen if len(chosen) >= view.units else None


class Fifo(BatchSelection):
    def choose(self, view: BatchView) -> list[Ready] | None:
        return self.fill([], view)


class Stratified(BatchSelection):
    def choose(self, view: BatchView) -> list[Ready] | None:
        issued = {lv: n for lv, n in view.issued_levels.items() if lv is not None}
        total = sum(issued.values())
        chosen: list[Ready] = []
        for level, n in issued.items():
            quota = math.floor(view.units * n / total)
            have = [r for r in view.buffer if r.level == level][:quota]
            if len(have) < quota and any(lv == level for lv, _ in view.generating):
                return None
            chosen += have
        return self.fill(chosen, view)


class Admission(BatchSelection):
    def choose(self, view: BatchView) -> list[Ready] | None:
        p = view.prompts_per_step
        chosen = sorted(view.buffer, key=lambda r: (r.start_version, r.completed_at))[:p]
        if len(chosen) < p:
            return None
        left = [v for _, v in view.generating]
        left += [r.start_version for r in view.buffer if r not in chosen]
        if not view.bound.leaves_room(left, view.version):
            return None  # a group outstanding now could not be trained within K: wait for it
        return self.fill(chosen, view)
