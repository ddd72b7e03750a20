"""Synchronous rollout: the global barrier.

Each call samples ``prompts_per_step`` prompts x ``group_size`` responses with the current
policy, scores each response as it finishes, and returns only when every group is complete.
The trainer then updates and the new weights reach the engine before the next call, so every
trained token comes from the current policy version (staleness 0; exactly K behind a delayed
sync, ``callbacks.weight_sync.lag``). The iteration lasts as
long as its slowest response: that idle tail is what the async modes remove.
"""

from __future__ import annotations

from collections import defaultdict

from data.rollout.controller import RolloutController
from data.rollout.experience import Experience
from data.rollout.scheduling import SCHEDULES, LengthPredictor
from modules.config_errors import check_choice
from modules.engine.types import SamplingConfig


class SyncRollout(RolloutController):
    def __init__(
        self, prompts_per_step: int, group_size: int, sampling: SamplingConfig, schedule: str = "fifo"
    ) -> None:
        super().__init__(prompts_per_step, group_size, sampling)
        check_choice("rollout.schedule", schedule, SCHEDULES)
        self.schedule = schedule
        self.lengths = LengthPredictor()

    def next_batch(self) -> list[Experience]:
        ctx = self.ctx
        assert ctx is not None, "controller not bound to an engine"
        plans = [self.plan_group(ctx.prompts.next()) for _ in range(self.prompts_per_step)]
        if self.schedule == "longest_first":  # ids (seeds) as FIFO's; only the order changes
            plans.sort(key=lambda group: -self.lengths.predict(group[0].row))
        rows = {group[0].group_id: group[0].row for group in plans}
        inflight = {}
        for group in plans:
            inflight.update(self.submit_planned(group))
        groups: dict[int, list[Experience]] = defaultdict(list)
        pending = set(inflight)
        while pending:
            done = ctx.engine.wait_any(pending)
            pending -= done
            for fut in done:
                p = inflight[fut]
                groups[p.group_id].append(self.to_experience(fut.result(), p))
        batch = []
        for gid in sorted(groups):
            self.lengths.observe(rows[gid], [len(e.response_ids) for e in groups[gid]])
            batch += self.finish_group(groups[gid])
        # 0 unless the weight sync is delayed (callbacks.weight_sync.lag): then the trainer is
        # ahead of the engine that generated the batch
        current = ctx.engine.version if self.trainer_version is None else self.trainer_version
        for e in batch:
            e.staleness = current - min(e.token_versions(), default=e.policy_version)
        return batch
