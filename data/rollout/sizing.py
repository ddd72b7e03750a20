"""How much a streaming rollout keeps generating: groups in flight and groups outstanding (in
flight + ready), from the engine and the batch instead of fixed numbers.

``rollout.max_inflight=auto``: at most the engine's concurrency in groups generate at once,
``ceil(engine.concurrency / G)`` (vLLM's ``max_num_seqs``): more would only queue, and queued
requests age without generating; and at most what the staleness bound lets the trainer use,
``P * s * (K + 1)`` with ``s`` batches per version (``data.sync_every``): with N groups
outstanding a group waits about N / (P s) versions (Little's law),
so more than that would mostly be dropped (a 4-group test batch on a 256-slot engine would
otherwise keep 64 groups generating). ``rollout.buffer_capacity=auto``: at most that plus
``P * s * (K + 1)`` groups outstanding (generating or ready), what can be trained before the oldest
exceeds the bound.

Rate matching (with ``max_inflight=auto``) sets the outstanding target from measured rates,
by Little's law: to have a batch ready whenever the trainer asks, about ``lambda x L`` groups
must be generating, where ``lambda`` is the rate groups leave generation (the trainer's batches
plus the groups dropped or refused meanwhile: counting only the trained ones would under-size
a dropping policy by its drop rate; a response dropped on its own, under per-response release,
counts 1/G of a group; groups per second, an exponential average over takes) and
``L`` the mean time a group takes from its start to its last response (over the last
``max(4 P, 32)`` groups), plus one batch (``P``) ready. The target is ``ceil(lambda L) + P``
within [``P``, the capacity]:

* a trainer-bound pipeline (generation outpaces training) keeps little more than what
  generates during one step, so groups do not wait in the buffer and grow stale;
* a generation-bound one finds ``lambda`` = the generation rate, so the target is what is
  generating plus a batch: it rises until the engine's concurrency (the in-flight ceiling)
  stops it;
* unlike a rule that reacts to the trainer's waits, it is not misled by waits whose cause is
  not a generation shortage (groups dropped as stale: more in flight only makes more of them
  stale).

Until a take and ``min(P, 8)`` groups are measured the target stays where it starts: the
in-flight ceiling + one batch. The measurements are not checkpointed (a resumed run measures
again). Integers for both fields keep the fixed behaviour (``buffer_capacity`` then bounds
generating + ready groups, as before). The target is logged as ``rollout/outstanding_target``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from data.rollout.staleness import trainable_groups


@dataclass
class Sizing:
    inflight: int  # groups generating at once, at most
    outstanding: int  # groups generating + ready, at most (the rate-matched target)
    low: int
    high: int
    adaptive: bool
    rate: float | None = None  # groups leaving generation per second (exponential average)
    latencies: deque = field(default_factory=lambda: deque(maxlen=32))  # group start -> done, s
    last_take: float | None = None

    @classmethod
    def of(cls, ctl: Any, concurrency: int | None) -> Sizing:
        p, g = ctl.prompts_per_step, ctl.group_size
        # a version trains batches_per_version batches (data.sync_every)
        # groups trainable within the bound if started now (the staleness bound's answer;
        # auto sizing needs a bound: StreamingRollout refuses auto with max_staleness=null)
        trainable = trainable_groups(p, ctl.batches_per_version, ctl.max_staleness)
        auto = ctl.max_inflight == "auto"
        if auto:
            inflight = min(math.ceil(concurrency / g), trainable) if concurrency else trainable
        else:
            inflight = int(ctl.max_inflight)
        high = inflight + trainable if ctl.buffer_capacity == "auto" else int(ctl.buffer_capacity)
        high = max(high, p)
        start = min(high, inflight + p) if auto else high
        window = deque(maxlen=max(4 * p, 32))
        return cls(inflight, start, min(p, high), high, auto, latencies=window)

    def adopt(self, old: Sizing) -> None:
        """Keep ``old``'s measurements and target (within the new bounds) after a resize."""
        self.rate, self.last_take = old.rate, old.last_take
        self.latencies.extend(old.latencies)
        self.outstanding = max(self.low, min(old.outstanding, self.high))

    def observe(self, latency_s: float) -> None:
        """A group completed ``latency_s`` after it started."""
        self.latencies.append(latency_s)

    def after_take(self, groups: int, now: float) -> None:
        """Rate matching after the trainer took a batch at ``now`` (engine clock); ``groups`` left
        generation since the last batch (this batch, and those dropped or refused meanwhile)."""
        if not self.adaptive:
            return
        if self.last_take is not None and now > self.last_take:
            inst = groups / (now - self.last_take)
            self.rate = inst if self.rate is None else 0.7 * self.rate + 0.3 * inst
        self.last_take = now
        if self.rate is None or len(self.latencies) < min(self.low, 8):
            return
        target = math.ceil(self.rate * statistics.fmean(self.latencies)) + self.low
        self.outstanding = max(self.low, min(target, self.high))
