"""What leaves a streaming controller untrained, and what the bound makes the batch take first.

A mixin of ``StreamingRollout`` (``streaming.py``), kept apart so each file has one job. Before
each batch is chosen:

* ``max_age_s``: a buffered group older than that (wall clock) is expired, its prompt re-queued.
* ``drop`` discards a buffered group past the bound, and with ``rollout.cancel_doomed`` cancels a
  generating one it would discard on arrival.
* ``regenerate`` (``staleness.Regenerate``) does the same two things but re-queues the prompt at
  the front of the stream, to be generated again with the current weights: nothing is dropped
  and nothing past the bound is trained. Groups that must be in this batch to stay within the
  bound go in first; a prompt already regenerated ``max_regenerations`` times is protected: the
  trainer waits for it when it is due instead of regenerating it once more, so a prompt too long
  for the bound is still trained (a barrier on that one group).
"""

from __future__ import annotations

from data.rollout.selection import Ready


class Retirement:
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

    def _protected(self, row: dict) -> bool:
        """Regenerated ``max_regenerations`` times already: waited for, not regenerated."""
        times = self._regenerations.get(self.ctx.prompts.index_of(row), 0)
        return self.bound.regenerates and times >= self.bound.policy.max_regenerations

    def _retire(self, version: int, now: float) -> None:
        """Expire, drop, cancel or regenerate what may no longer be trained (see the module)."""
        if self.max_age_s is not None:
            for r in [r for r in self._buffer if now - r.completed_at > self.max_age_s]:
                # Too old to train: a whole group's prompt is generated again with fresher weights
                # (nothing is lost, even under Admit). A single response of a running-baseline
                # group is only discarded.
                self._buffer.remove(r)
                self.counters["expired"] += 1
                if self._units_per_group == 1:
                    self._requeue(r.exps[0].extras["row"], r.level)
        if self.cancel_doomed or self.bound.regenerates:
            self._cancel_doomed(version)
        for r in [r for r in self._buffer if self.bound.too_stale(version, r.start_version)]:
            self._buffer.remove(r)
            if self.bound.regenerates:
                self._regenerate(r.exps[0].extras["row"], r.level)
                continue
            self.counters["dropped"] += 1  # buffer units: groups, or responses when released singly
            self._wasted_groups += 1 / self._units_per_group

    def _cancel_doomed(self, version: int) -> None:
        """Cancel generating groups a dropping policy will discard on arrival (``regenerate``:
        will regenerate; a protected group is waited for instead, see ``_waits_for_due``).
        Staleness counts from the oldest *generated* token, known only at completion; a request
        starts at or after its submission, so a group is doomed once its submission is more
        than K + 1 versions old (exact while requests start within a version: no long engine
        queue)."""
        doomed = {gid for gid, g in self._groups.items() if self.bound.doomed(version, g.start_version)}
        if not doomed:
            return
        for fut, p in list(self._requests.items()):
            if p.group_id in doomed:
                del self._requests[fut]
                fut.cancel()
        for gid in doomed:
            group = self._groups.pop(gid)
            self.counters["cancelled"] += 1
            if self.bound.regenerates:
                self._regenerate(group.row, group.row.get("level"))
                continue
            # under per-response release its finished responses are already in the buffer
            released = len(group.exps) if self._units_per_group > 1 else 0
            self._wasted_groups += 1 - released / self.group_size
            self.counters["dropped"] += 1

    def _protected_due_buffered(self, version: int) -> int:
        return sum(
            self._protected(r.exps[0].extras["row"]) and self.bound.due(version, r.start_version)
            for r in self._buffer
        )

    def _waits_for_due(self, version: int) -> bool:
        """``regenerate``: a protected group still generating is due (the batch taken now must
        hold it) and the batch has a place for it: the trainer waits for it to complete. More
        protected groups due at once than a batch holds (rare: each was regenerated already)
        are regenerated again rather than waited for."""
        if not self.bound.regenerates or self._protected_due_buffered(version) >= self._batch_units:
            return False
        return any(
            self._protected(g.row) and self.bound.due(version, g.start_version) for g in self._groups.values()
        )

    def _due_first(self, chosen: list[Ready], version: int) -> list[Ready]:
        """``regenerate``: every buffered group that must be in this batch to stay within the
        bound is ranked (protected first, then oldest); the first of them take the batch's
        places and the selection rule's other picks fill the rest (so under ``stratified`` a
        due group may take another level's place: the bound comes first)."""
        if not self.bound.regenerates:
            return chosen
        due = [r for r in self._buffer if self.bound.due(version, r.start_version)]
        if not due:
            return chosen
        due.sort(
            key=lambda r: (not self._protected(r.exps[0].extras["row"]), r.start_version, r.completed_at)
        )
        due = due[: len(chosen)]
        return due + [r for r in chosen if r not in due][: len(chosen) - len(due)]

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
