"""Orchestration overhead: how many samples/s the rollout path itself can move.

    python -m lab.overhead                      # streaming, P=16 x G=8, 1-token responses

A zero-latency SimEngine (every response finishes at once, one token long) and a no-op trainer
isolate the Python cost of the real path: request bookkeeping, reward, group assembly and
advantages, buffer and staleness policy, bias tracking, and collation into tensors. Prints one
JSON object with samples/s per mode; real engines run orders of magnitude slower.
"""

from __future__ import annotations

import json
import time

from data.rollout.controller import RolloutContext
from data.rollout.experience import collate
from data.rollout.partial import PartialRollout
from data.rollout.prompts import PromptStream
from data.rollout.streaming import StreamingRollout
from data.rollout.sync import SyncRollout
from modules.algo.advantages import GroupAdvantage
from modules.engine import SamplingConfig
from modules.engine.sim import CharTokenizer, SimEngine, SimTask


def measure(make, batches: int = 200) -> float:
    engine = SimEngine()
    task = SimTask([1] * 5000)
    ctl = make()
    ctl.bind(RolloutContext(engine, task, CharTokenizer(), PromptStream(task.rows), GroupAdvantage()))
    n = 0
    t0 = time.perf_counter()
    for _ in range(batches):
        batch = ctl.next_batch()
        collate(batch, pad_id=0)
        n += len(batch)
        engine.update_weights({}, engine.version + 1, inflight="keep")
    return n / (time.perf_counter() - t0)


def main() -> None:
    s = SamplingConfig(max_tokens=8)
    result = {
        "sync_samples_per_s": measure(lambda: SyncRollout(16, 8, s)),
        "partial_samples_per_s": measure(lambda: PartialRollout(16, 8, s, over_provision=2.0)),
        "streaming_samples_per_s": measure(
            lambda: StreamingRollout(16, 8, s, max_inflight=32, max_staleness=1, buffer_capacity=64)
        ),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
