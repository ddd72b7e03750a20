"""What leaves a streaming controller untrained: the operations a staleness policy performs.

A mixin of ``StreamingRollout`` (``streaming.py``), kept apart so each file has one job. The
policies (``staleness.py``) decide; this file carries their decisions out on the controller's
buffer and groups and keeps the counts (``rollout/dropped``, ``cancelled``, ``regenerated``,
``expired``) and the generation they wasted (rate matching's input). Before each batch is chosen:

* ``max_age_s``: a buffered group older than that (wall clock) is expired, its prompt re-queued
  (every policy: it is about wall-clock freshness, not versions).
* then the policy's ``retire``: ``drop`` discards a buffered group past the bound (and with
  ``rollout.cancel_doomed`` cancels a generating one it would discard on arrival);
  ``regenerate`` does both always, re-queueing the prompt at the front of the stream to be
  generated again with the current weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from data.rollout.selection import Ready


class Retirement:
    """What a staleness policy sees of a streaming controller and does to its groups."""

    # ------------------------------------------------------------------ what a policy sees
    @property
    def batch_units(self) -> int:
        return self._batch_units

    def buffered(self) -> list[Ready]:
        return list(self._buffer)

    def generating(self) -> list[tuple[int, dict, int]]:
        """(group id, prompt row, start version) of each group still generating."""
        return [(gid, g.row, g.start_version) for gid, g in self._groups.items()]

    @staticmethod
    def row_of(ready: Ready) -> dict:
        return ready.exps[0].extras["row"]

    def regenerations(self, row: dict) -> int:
        """Times this prompt was regenerated (``regenerate``'s protection counts them)."""
        return self._regenerations.get(self.ctx.prompts.index_of(row), 0)

    # ------------------------------------------------------------------ what a policy does
    def drop_buffered(self, ready: Ready) -> None:
        self._buffer.remove(ready)
        self.counters["dropped"] += 1  # buffer units: groups, or responses when released singly
        self._wasted_groups += 1 / self._units_per_group

    def regenerate_buffered(self, ready: Ready) -> None:
        self._buffer.remove(ready)
        self._regenerate(self.row_of(ready), ready.level)

    def drop_generating(self, group_ids: set[int]) -> None:
        def drop(group: object) -> None:
            # under per-response release its finished responses are already in the buffer
            released = len(group.exps) if self._units_per_group > 1 else 0
            self._wasted_groups += 1 - released / self.group_size
            self.counters["dropped"] += 1

        self._cancel(group_ids, drop)

    def regenerate_generating(self, group_ids: set[int]) -> None:
        self._cancel(group_ids, lambda group: self._regenerate(group.row, group.row.get("level")))

    def _cancel(self, group_ids: set[int], then: Callable[[Any], None]) -> None:
        """Cancel the requests of generating groups, then hand each group to ``then``. Staleness
        counts from the oldest generated token, known only at completion; a request starts at or
        after its submission, so a group is doomed once its submission is more than K + 1
        versions old (exact while requests start within a version: no long engine queue)."""
        if not group_ids:
            return
        for fut, p in list(self._requests.items()):
            if p.group_id in group_ids:
                del self._requests[fut]
                fut.cancel()
        for gid in group_ids:
            group = self._groups.pop(gid)
            self.counters["cancelled"] += 1
            then(group)

    # ------------------------------------------------------------------ prompts back in the stream
    def _requeue(self, row: dict, level: object) -> None:
        """The prompt goes back to the front of the stream; its samples are issued again."""
        self.ctx.prompts.requeue([self.ctx.prompts.index_of(row)])
        self.bias.on_issue(level, -self.group_size)  # counted again when re-issued

    def _regenerate(self, row: dict, level: object) -> None:
        index = self.ctx.prompts.index_of(row)
        self._regenerations[index] = self._regenerations.get(index, 0) + 1
        self._requeue(row, level)
        self.counters["regenerated"] += 1
        self._wasted_groups += 1
        self._replace_regenerated()

    def _replace_regenerated(self) -> None:
        """Hook: streaming tops up while it waits; partial rollout starts the prompt at once."""

    def _retire(self, version: int, now: float) -> None:
        """Expire what is too old, then what the staleness policy retires (see the module)."""
        if self.max_age_s is not None:
            for r in [r for r in self._buffer if now - r.completed_at > self.max_age_s]:
                # Too old to train: a whole group's prompt is generated again with fresher weights
                # (nothing is lost, even under Admit). A single response of a running-baseline
                # group is only discarded.
                self._buffer.remove(r)
                self.counters["expired"] += 1
                if self._units_per_group == 1:
                    self._requeue(self.row_of(r), r.level)
        self.bound.policy.retire(self.bound, self, version)

    def _trained(self, rows: list[dict]) -> None:
        """Prompts trained at last: their regeneration counts are done (kept aside until the
        next batch, in case a checkpoint gives this one back)."""
        self._handed_regenerations = {}
        for row in rows:
            index = self.ctx.prompts.index_of(row)
            if index in self._regenerations:
                self._handed_regenerations[index] = self._regenerations.pop(index)

    def _forget(self, row: dict) -> None:
        """A prompt refused by ``rollout.group_filter`` is not generated again: no count left."""
        self._regenerations.pop(self.ctx.prompts.index_of(row), None)
