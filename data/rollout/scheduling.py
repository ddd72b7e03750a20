"""Length-aware scheduling: when a rollout batch holds more requests than the engine runs at
once, submit the groups predicted to be longest first (Seer-style longest-processing-time
first), so the longest responses do not start last and stretch the barrier.

    python train.py rollout.schedule=longest_first      # sync rollout; fifo is the default
    python -m tools.pipeline rollout=sync rollout.schedule=longest_first sim.concurrency=8

The prediction never reads the answer: it is the mean response length this prompt's last
group produced (prompts come round again each epoch), else the running mean of its difficulty
level (``row["level"]``), else of everything seen so far. Groups keep the ids (and so the
seeds) FIFO would give them: only the submission order changes (on the simulator both
schedules sample the same responses; on vLLM the batch a request shares can move its numerics
slightly, as any change of concurrency does). With a batch no larger than the engine's concurrency
the order does not matter (everything starts at once). The predictor is not checkpointed (a
resumed run re-learns it within a batch).
"""

from __future__ import annotations

from collections import defaultdict

SCHEDULES = ("fifo", "longest_first")


class LengthPredictor:
    def __init__(self) -> None:
        self.by_prompt: dict[object, float] = {}
        self.level_sum: dict[object, float] = defaultdict(float)
        self.level_n: dict[object, int] = defaultdict(int)
        self.total, self.n = 0.0, 0

    def observe(self, row: dict, lengths: list[int]) -> None:
        """The response lengths one group of ``row`` produced."""
        if not lengths:
            return
        mean = sum(lengths) / len(lengths)
        self.by_prompt[row.get("id")] = mean
        level = row.get("level")
        self.level_sum[level] += sum(lengths)
        self.level_n[level] += len(lengths)
        self.total += sum(lengths)
        self.n += len(lengths)

    def predict(self, row: dict) -> float:
        if row.get("id") in self.by_prompt:
            return self.by_prompt[row.get("id")]
        level = row.get("level")
        if self.level_n.get(level):
            return self.level_sum[level] / self.level_n[level]
        return self.total / self.n if self.n else 0.0
