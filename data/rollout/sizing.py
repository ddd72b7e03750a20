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

Rate matching (with ``max_inflight=auto``) moves the outstanding target between one batch
(``P`` groups) and that capacity after every batch the trainer takes:

* the trainer had to wait for it: generation is the bottleneck, one notch (``ceil(P / 4)``
  groups) more;
* it did not wait and at least a notch of groups is still ready after it: generation
  outpaces training, one notch less. Groups started early would only wait in the buffer and
  grow stale (dropped, or trained further off-policy).

It starts at the in-flight ceiling + one batch and is not checkpointed (a resumed run starts
there again). Integers for both fields keep the fixed behaviour (``buffer_capacity`` then bounds generating + ready groups, as before). The target is
logged as ``rollout/outstanding_target``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class Sizing:
    inflight: int  # groups generating at once, at most
    outstanding: int  # groups generating + ready, at most (the rate-matched target)
    low: int
    high: int
    adaptive: bool
    notch: int

    @classmethod
    def of(cls, ctl: Any, concurrency: int | None) -> Sizing:
        p, g = ctl.prompts_per_step, ctl.group_size
        # a version trains batches_per_version batches (data.sync_every)
        trainable = p * ctl.batches_per_version * (min(ctl.max_staleness, 1_000) + 1)
        auto = ctl.max_inflight == "auto"
        if auto:
            inflight = min(math.ceil(concurrency / g), trainable) if concurrency else trainable
        else:
            inflight = int(ctl.max_inflight)
        high = inflight + trainable if ctl.buffer_capacity == "auto" else int(ctl.buffer_capacity)
        high = max(high, p)
        start = min(high, inflight + p) if auto else high
        return cls(inflight, start, min(p, high), high, auto, max(1, math.ceil(p / 4)))

    def after_take(self, waited: bool, ready_left: float) -> None:
        """Rate matching after the trainer took a batch (``ready_left``: groups still ready)."""
        if not self.adaptive:
            return
        if waited:
            self.outstanding = min(self.high, self.outstanding + self.notch)
        elif ready_left >= self.notch:
            self.outstanding = max(self.low, self.outstanding - self.notch)
