"""What a streaming controller's checkpoint holds, and the counts it reports.

A mixin of ``StreamingRollout`` (``streaming.py``), kept apart so each file has one job: the
buffer and in-flight groups are not saved; their prompts are re-queued on resume (each is
trained once, regenerated with the checkpoint's weights), and the counts that decide what
is trained next (admission, reweighting, issued levels) are. A batch in training with none of
its optimizer steps done is given back the same way (``handoff.py``).
"""

from __future__ import annotations

from typing import Any


class StreamingCheckpoint:
    def snapshot(self) -> dict[str, Any]:
        """Counts for tests and metrics (taken under the lock)."""
        with self._cv:
            return {
                "buffer": len(self._buffer),
                "inflight_groups": len(self._groups),
                "inflight_requests": len(self._requests),
                "started_groups": self.started_groups,
                **self.counters,
            }

    def batches_taken_this_version(self) -> int:
        with self._cv:
            return self.bound.taken(self.ctx.engine.version)

    def requeued_groups(self, in_training: bool = False) -> dict[int, dict]:
        """Group id -> row of the groups a checkpoint re-queues (oldest first): the batch given
        back (``in_training``), then those generating, then those buffered.

        Policy: a checkpoint does not store partial generations; the prompts of outstanding
        groups are re-queued at the front on resume, so each is trained once (regenerated
        with the checkpoint's weights)."""
        with self._cv:
            rows = super().requeued_groups(in_training)
            for gid, g in self._groups.items():
                rows.setdefault(gid, g.row)
            for r in self._buffer:
                if r.exps and "row" in r.exps[0].extras:
                    rows.setdefault(r.group_id, r.exps[0].extras["row"])
            return rows

    def state_dict(self, in_training: bool = False) -> dict[str, Any]:
        """Everything that changes what is trained next. Outstanding groups are re-issued on
        resume (their prompts are re-queued), so they are taken out of the issued counts;
        ``in_training``: the batch handed out last is given back (``handoff.py``)."""
        with self._cv:
            trained_levels = dict(self._trained_levels)
            handed = self._given_back(in_training)
            if handed is not None and self.reweight:  # reweighting counted it when it was taken
                for e in handed.exps:
                    trained_levels[e.difficulty] -= 1
            return {
                **super().state_dict(in_training),
                "started_groups": self.started_groups,
                **self._taken_state(in_training),  # batches taken at this version (throttle, admit)
                "trained_levels": [[k, v] for k, v in trained_levels.items()],  # reweighting
                "counters": dict(self.counters),
                "regenerations": [[k, v] for k, v in self._regenerations_state(in_training).items()],
            }

    def _regenerations_state(self, in_training: bool) -> dict[int, int]:
        """``regenerate``'s counts per prompt; a batch given back keeps its prompts' counts."""
        counts = dict(self._regenerations)
        if in_training:
            counts.update(self._handed_regenerations)
        return counts

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.started_groups = int(state.get("started_groups", 0))
        self.bound.load_state_dict(state)
        self._trained_levels = {k: v for k, v in state.get("trained_levels", [])}
        self.counters.update(state.get("counters", {}))
        self._regenerations = {int(k): int(v) for k, v in state.get("regenerations", [])}
