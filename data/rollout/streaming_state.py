"""What a streaming controller's checkpoint holds, and the counts it reports.

A mixin of ``StreamingRollout`` (``streaming.py``), kept apart so each file has one job: the
buffer and in-flight groups are not saved; their prompts are re-queued on resume (each is
trained once, regenerated with the checkpoint's weights), and the counts that decide what
is trained next (admission, reweighting, issued levels) are.
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

    def outstanding_prompts(self) -> list[int]:
        """Row indexes of groups generating or buffered (oldest first), for checkpoints.

        Policy: a checkpoint does not store partial generations; the prompts of outstanding
        groups are re-queued at the front on resume, so each is trained once (regenerated
        with the checkpoint's weights)."""
        with self._cv:
            prompts = self.ctx.prompts
            rows = {gid: g.row for gid, g in self._groups.items()}
            for r in self._buffer:
                if r.exps and "row" in r.exps[0].extras:
                    rows.setdefault(r.group_id, r.exps[0].extras["row"])
            return [prompts.index_of(row) for row in rows.values()]

    def state_dict(self) -> dict[str, Any]:
        """Everything that changes what is trained next. Outstanding groups are re-issued on
        resume (their prompts are re-queued), so they are taken out of the issued counts."""
        with self._cv:
            state = super().state_dict()
            levels = {gid: g.row.get("level") for gid, g in self._groups.items()}
            for r in self._buffer:
                levels.setdefault(r.group_id, r.level)
            issued = dict(self.bias.issued_levels)
            for level in levels.values():  # each outstanding group is issued again, G samples
                issued[level] -= self.group_size
            state["bias"]["issued_levels"] = [[k, v] for k, v in issued.items()]
            return {
                **state,
                "started_groups": self.started_groups,
                **self.bound.state_dict(),  # batches taken at this version (throttle, admit)
                "trained_levels": [[k, v] for k, v in self._trained_levels.items()],  # reweighting
                "counters": dict(self.counters),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.started_groups = int(state.get("started_groups", 0))
        self.bound.load_state_dict(state)
        self._trained_levels = {k: v for k, v in state.get("trained_levels", [])}
        self.counters.update(state.get("counters", {}))
