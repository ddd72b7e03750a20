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
from data.rollout.shaping import InformativeGroups, Overlong
from modules.config.errors import check_choice
from modules.engine.types import SamplingConfig


class SyncRollout(RolloutController):
    barrier = True

    def __init__(
        self,
        prompts_per_step: int,
        group_size: int,
        sampling: SamplingConfig,
        schedule: str = "fifo",
        group_filter: InformativeGroups | None = None,
        overlong: Overlong | None = None,
    ) -> None:
        super().__init__(prompts_per_step, group_size, sampling, group_filter, overlong)
        check_choice("rollout.schedule", schedule, SCHEDULES)
        self.schedule = schedule
        self.lengths = LengthPredictor()
        # group id -> row of every group drawn by the next_batch in progress: an interrupt
        # while it generates re-queues them (handoff.py)
        self._drawn: dict[int, dict] = {}

    def next_batch(self) -> list[Experience]:
        ctx = self.ctx
        assert ctx is not None, "controller not bound to an engine"
        self._drawn = {}
        batch = self._round(self.prompts_per_step)
        if self.group_filter is not None:
            batch = self._informative_batch(batch)
        # 0 unless the weight sync is delayed (callbacks.weight_sync.lag): then the trainer is
        # ahead of the engine that generated the batch
        current = ctx.engine.version if self.trainer_version is None else self.trainer_version
        for e in batch:
            e.staleness = current - e.oldest_version()
        self.hand_out({e.group_id: self._drawn[e.group_id] for e in batch}, batch)
        self._drawn = {}
        return batch

    def _round(self, n_groups: int) -> list[Experience]:
        """Sample ``n_groups`` groups with the current weights and wait for all of them."""
        ctx = self.ctx
        assert ctx is not None
        plans = [self.plan_group(ctx.prompts.next()) for _ in range(n_groups)]
        self._drawn.update((group[0].group_id, group[0].row) for group in plans)
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
        return batch

    def _informative_batch(self, batch: list[Experience]) -> list[Experience]:
        """Dynamic sampling: more rounds until P informative groups (``data/rollout/shaping.py``);
        surplus informative groups are not trained (counted in ``rollout/filter_surplus``)."""
        f, p, g = self.group_filter, self.prompts_per_step, self.group_size
        assert f is not None
        groups = [batch[i : i + g] for i in range(0, len(batch), g)]
        kept = [x for x in groups if self.informative(x)]
        refused = [x for x in groups if not self.informative(x)]
        seen = len(groups)
        for _ in range(f.max_rounds):
            if len(kept) >= p:
                break
            more = self._round(f.extra_groups(p - len(kept), len(kept), seen, 4 * p))
            fresh = [more[i : i + g] for i in range(0, len(more), g)]
            seen += len(fresh)
            kept += [x for x in fresh if self.informative(x)]
            refused += [x for x in fresh if not self.informative(x)]
        fill = max(0, p - len(kept))
        count = self.stats.get
        self.stats["rollout/filtered"] = count("rollout/filtered", 0.0) + len(refused)
        self.stats["rollout/filter_fill"] = count("rollout/filter_fill", 0.0) + fill
        self.stats["rollout/filter_surplus"] = count("rollout/filter_surplus", 0.0) + max(0, len(kept) - p)
        self.stats["rollout/groups_sampled_per_trained"] = seen / p
        chosen = kept[:p] + refused[:fill]
        for x in kept[p:] + refused[fill:]:  # sampled, not trained: out of the issued counts
            self.bias.on_issue(x[0].difficulty, -len(x))
        return [e for x in chosen for e in x]

    def requeued_groups(self, in_training: bool = False) -> dict[int, dict]:
        return {**super().requeued_groups(in_training), **self._drawn}

    def state_dict(self, in_training: bool = False) -> dict:
        """The base's, plus dynamic sampling's running counts (so they continue on resume)."""
        counts = {k: v for k, v in self.stats.items() if k.startswith("rollout/filter")}
        # re-queued groups keep their ids: a resumed run regenerates them with the same seeds
        state = {**super().state_dict(in_training), "next_group_id": self._next_group_id(in_training)}
        return {**state, "filter_counts": counts}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.stats.update(state.get("filter_counts", {}))
