"""Default task: remainder by repeated subtraction, with a scratchpad the verifier checks.

Prompt ``"21%2="``; correct response ``"19,17,15,13,11,9,7,5,3,1."`` then end-of-sequence:
every value ``a - k*b`` down to ``a mod b``. The number of steps is ``a // b``, so the
difficulty level sets the response length: level 0 takes 1-3 steps (about 4 characters),
level 1 4-12 steps (about 18), level 2 13-40 steps (about 73), an 18x spread; the default mix
(60/30/10 %) is long-tailed, which is what makes a synchronous barrier costly.

Reward is 1.0 only if the whole scratchpad is right (a guessed final number earns nothing),
so a per-step error rate e gives accuracy (1-e)^steps: longer prompts fail more often.

    python -m data.tasks.remainder      # print a few examples and the length figures

The default task of every recipe on the tiny model (``sft_warmup``, ``sync_grpo``, ...). For a
new task copy this file (keep ``build`` / ``prompt_text`` / ``reward``, see ``data/tasks``) and
point a recipe's ``task._target_`` at it (see README, "Copying a recipe").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from datasets import Dataset

from modules.config_errors import check

# (min steps, max steps) per difficulty level.
LEVELS: tuple[tuple[int, int], ...] = ((1, 3), (4, 12), (13, 40))


def solve(a: int, b: int) -> str:
    """The reference scratchpad for ``a % b``."""
    values = list(range(a - b, -1, -b))
    values = [v for v in values if v >= 0]
    return ",".join(map(str, values)) + "."


def make_problem(rng: random.Random, level: int, max_value: int = 99, max_divisor: int = 2) -> dict:
    """A problem of the given level with ``a <= max_value`` and ``b <= max_divisor``.

    Small numbers keep each step a lookup a 0.8M-parameter model learns in minutes; the
    chain length (set by the level) is what makes a prompt hard.
    """
    lo, hi = LEVELS[level]
    steps = rng.randint(lo, hi)
    b = rng.randint(1, max(1, min(max_divisor, max_value // (steps + 1))))
    r = rng.randint(0, b - 1)
    a = steps * b + r
    return {"prompt": f"{a}%{b}=", "answer": solve(a, b), "level": level, "steps": steps}


@dataclass
class RemainderTask:
    """Generates the dataset and scores responses. Every split is a pure function of the seed."""

    level_weights: tuple[float, ...] = (0.6, 0.3, 0.1)
    max_divisor: int = 2
    seed: int = 0
    name: str = "remainder"

    def __post_init__(self) -> None:
        self.level_weights = tuple(float(w) for w in self.level_weights)
        check(
            "task.level_weights",
            list(self.level_weights),
            len(self.level_weights) == len(LEVELS)
            and min(self.level_weights) >= 0
            and sum(self.level_weights) > 0,
            f"{len(LEVELS)} non-negative weights, not all zero",
        )
        check("task.max_divisor", self.max_divisor, 1 <= self.max_divisor <= 9, "an int in [1, 9]")

    def build(self, split: str, size: int, level_weights: tuple[float, ...] | None = None) -> Dataset:
        """``split`` in train / eval / sft; different splits use different seeds.

        ``level_weights`` overrides the difficulty mix for this split only (the SFT warm start
        sees more long problems than the RL prompt stream does).
        """
        offsets = {"train": 0, "eval": 1, "sft": 2}
        if split not in offsets:  # a caller's mistake, not a config value
            raise ValueError(f"split={split!r}: must be one of {', '.join(offsets)}")
        rng = random.Random(self.seed * 1000 + offsets[split])
        weights = self.level_weights if level_weights is None else tuple(level_weights)
        levels = rng.choices(range(len(LEVELS)), weights=weights, k=size)
        rows = [make_problem(rng, lv, max_divisor=self.max_divisor) for lv in levels]
        for i, row in enumerate(rows):
            row["id"] = i
        return Dataset.from_list(rows)

    def prompt_text(self, row: dict) -> str:
        return row["prompt"]

    def reward(self, row: dict, response: str) -> float:
        """1.0 iff the response is exactly the reference scratchpad."""
        return 1.0 if response.strip() == row["answer"] else 0.0


if __name__ == "__main__":
    task = RemainderTask()
    for row in task.build("train", 8):
        print(row)
    rows = task.build("train", 3000).to_list()
    for level in range(len(LEVELS)):
        lens = [len(r["answer"]) for r in rows if r["level"] == level]
        print(
            f"level {level}: {len(lens) / len(rows):.0%} of prompts, mean reference length {sum(lens) / len(lens):.1f}"
        )
