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


class SyncRollout(RolloutController):
    def next_batch(self) -> list[Experience]:
        ctx = self.ctx
        assert ctx is not None, "controller not bound to an engine"
        inflight = {}
        for _ in range(self.prompts_per_step):
            inflight.update(self.submit_group(ctx.prompts.next()))
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
            batch += self.finish_group(groups[gid])
        # 0 unless the weight sync is delayed (callbacks.weight_sync.lag): then the trainer is
        # ahead of the engine that generated the batch
        current = ctx.engine.version if self.trainer_version is None else self.trainer_version
        for e in batch:
            e.staleness = current - min(e.token_versions(), default=e.policy_version)
        return batch
