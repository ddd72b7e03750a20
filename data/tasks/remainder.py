"""Default task: remainder by repeated subtraction, with a scratchpad the verifier checks.

Prompt ``"9%2="``; correct response ``"9-2=7;7-2=5;5-2=3;3-2=1."`` then end-of-sequence: one
step per subtraction down to ``a mod b``. The number of steps is ``a // b``, so the difficulty
level sets the response length: level 0 takes 2-4 steps (about 18 characters), level 1 6-12
steps (about 64), level 2 22-36 steps (about 220), a 12x spread; the default mix (60/30/10 %)
is long-tailed, which is what makes a synchronous barrier costly (a batch's slowest response
is 10-15x its median).

Reward (``credit``):

* ``prefix`` (default): the share of the reference's steps the response reproduces before its
  first mistake, ``k / n``; 1.0 only for the exact scratchpad (the last step carries the final
  ``.``), so a guessed final number earns nothing and a run that stops early or overshoots
  loses the rest. A graded outcome reward, not a process reward model: the verifier is the
  same string comparison as ``exact``, read left to right. Evaluation logs the exact-match rate
  beside it (``eval/*exact*``: responses whose reward is 1.0).
* ``exact``: 1.0 iff the whole scratchpad is right.

Warm start. The SFT split's ``demo`` is what a sloppy demonstrator writes: at each step it
subtracts one more or one less than ``b`` with probability ``demo_slip`` and carries on from
the value it wrote (the slip propagates, as a student's would). A model trained on these
demonstrations learns the right step as the most likely one and slips at about that rate at
every step, so greedy decoding is mostly right while samples at temperature 1 slip: every level
starts with mixed groups, and RL has one clear job (stop slipping) shared by all lengths. See
docs/modes.md, "The default task".

    python -m data.tasks.remainder      # print a few examples and the length figures

The default task of every recipe on the tiny model (``sft_warmup``, ``sync_grpo``, ...). For a
new task copy this file (keep ``build`` / ``prompt_text`` / ``reward``, see ``data/tasks``) and
point a recipe's ``task._target_`` at it (see README, "Writing your own").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from datasets import Dataset

from data.tasks import level_weights
from modules.config.errors import check

# (min steps, max steps) per difficulty level.
LEVELS: tuple[tuple[int, int], ...] = ((2, 4), (6, 12), (22, 36))
CREDITS = ("prefix", "exact")


def scratchpad(a: int, b: int, results: list[int]) -> str:
    """``a%b`` worked as ``"a-b=r1;r1-b=r2;...;r(n-1)-b=rn."``: each step restates the value it
    starts from, so both operands sit next to the result."""
    starts = [a, *results[:-1]]
    return ";".join(f"{v}-{b}={w}" for v, w in zip(starts, results)) + "."


def solve(a: int, b: int) -> str:
    """The reference scratchpad for ``a % b``: subtract ``b`` until the value is below ``b``."""
    return scratchpad(a, b, list(range(a - b, -1, -b)))


def demonstrate(a: int, b: int, slip: float, rng: random.Random) -> str:
    """A demonstrator's scratchpad: each step subtracts ``b``, or with probability ``slip`` one
    more or one less (one more when ``b = 1``, so a slip never stalls; never below 0),
    continuing from the value it wrote; it stops at the first value below ``b``."""
    results, v = [], a
    while v >= b:
        w = v - b
        if rng.random() < slip:
            w = v - b - (1 if b == 1 else rng.choice((-1, 1)))
            if w < 0:
                w = v - b
        results.append(w)
        v = w
    return scratchpad(a, b, results)


def prefix_credit(answer: str, response: str) -> float:
    """Share of the reference's steps (``;``-separated) reproduced before the first mismatch.
    1.0 exactly when the response is the reference: anything written after its final ``.``
    costs the last step (the run did not stop where the work ends)."""
    if response.strip() == answer:
        return 1.0
    ref = answer.split(";")
    got = response.strip().split(";")
    k = 0
    for r, g in zip(ref, got):
        if r != g:
            break
        k += 1
    return min(k, len(ref) - 1) / len(ref)


def make_problem(
    rng: random.Random, level: int, max_divisor: int = 3, max_value: int = 99, min_divisor: int = 2
) -> dict:
    """A problem of the given level with ``a <= max_value`` and ``min_divisor <= b <= max_divisor``
    (``b`` as large as the level's step count allows).

    Two-digit numbers and small divisors keep each step a lookup a 0.8M-parameter model learns
    in minutes, the same lookups at every level; the number of steps (set by the level) is what
    makes a prompt long.
    """
    lo, hi = LEVELS[level]
    steps = rng.randint(lo, hi)
    b = rng.randint(min_divisor, max(min_divisor, min(max_divisor, max_value // (steps + 1))))
    r = rng.randint(0, b - 1)
    a = steps * b + r
    return {"prompt": f"{a}%{b}=", "answer": solve(a, b), "level": level, "steps": steps}


@dataclass
class RemainderTask:
    """Generates the dataset and scores responses. Every split is a pure function of the seed."""

    level_weights: tuple[float, ...] = (0.6, 0.3, 0.1)
    min_divisor: int = 2
    max_divisor: int = 3
    credit: str = "prefix"
    demo_slip: float = 0.3
    seed: int = 0
    name: str = "remainder"

    def __post_init__(self) -> None:
        self.level_weights = level_weights(self.level_weights, len(LEVELS))
        longest = LEVELS[-1][1]
        check(
            "task.min_divisor",
            self.min_divisor,
            1 <= self.min_divisor and self.min_divisor * (longest + 1) <= 99,
            f"an int in [1, {99 // (longest + 1)}]: the longest level takes {longest} steps with numbers below 100",
        )
        check(
            "task.max_divisor",
            self.max_divisor,
            self.min_divisor <= self.max_divisor <= 9,
            f"an int in [task.min_divisor={self.min_divisor}, 9]",
        )
        check("task.credit", self.credit, self.credit in CREDITS, " | ".join(CREDITS))
        check("task.demo_slip", self.demo_slip, 0.0 <= self.demo_slip < 1.0, "a float in [0, 1)")

    def build(self, split: str, size: int, level_weights: tuple[float, ...] | None = None) -> Dataset:
        """``split`` in train / eval / sft; different splits use different seeds.

        ``level_weights`` overrides the difficulty mix for this split only (the SFT warm start
        sees more long problems than the RL prompt stream does). Rows of the ``sft`` split carry
        ``demo``, the sloppy demonstrator's response the warm start imitates.
        """
        offsets = {"train": 0, "eval": 1, "sft": 2}
        if split not in offsets:  # a caller's mistake, not a config value
            raise ValueError(f"split={split!r}: must be one of {', '.join(offsets)}")
        rng = random.Random(self.seed * 1000 + offsets[split])
        weights = self.level_weights if level_weights is None else tuple(level_weights)
        levels = rng.choices(range(len(LEVELS)), weights=weights, k=size)
        rows = [make_problem(rng, lv, self.max_divisor, min_divisor=self.min_divisor) for lv in levels]
        for i, row in enumerate(rows):
            row["id"] = i
            if split == "sft":
                a, b = map(int, row["prompt"][:-1].split("%"))
                row["demo"] = demonstrate(a, b, self.demo_slip, rng)
        return Dataset.from_list(rows)

    def prompt_text(self, row: dict) -> str:
        return row["prompt"]

    def reward(self, row: dict, response: str) -> float:
        """``prefix``: share of reference values right before the first mistake (1.0 iff exact);
        ``exact``: 1.0 iff the response is exactly the reference scratchpad."""
        if self.credit == "exact":
            return 1.0 if response.strip() == row["answer"] else 0.0
        return prefix_credit(row["answer"], response)


if __name__ == "__main__":
    task = RemainderTask()
    for row in task.build("sft", 6):
        print(row)
    rows = task.build("train", 3000).to_list()
    for level in range(len(LEVELS)):
        lens = [len(r["answer"]) for r in rows if r["level"] == level]
        print(
            f"level {level}: {len(lens) / len(rows):.0%} of prompts, mean reference length "
            f"{sum(lens) / len(lens):.1f}, max {max(lens)}"
        )
