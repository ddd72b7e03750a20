"""Multi-turn task: multiplication with a calculator tool the model must learn to call.

Prompt ``"47*38?"``. The model answers at once (``"a1786."``, then end-of-sequence) or calls
the calculator first: ``"c="`` calls it on the question (``"c47*38="`` on an expression of its
own; a call ends at the stop token ``=``), the environment answers with the result and ``;``
(``"1786;"``, an observation: in the context, out of the loss), and the model answers in its
next turn, either with the number (``"a1786."``) or with ``"a."``, which submits the result on
the calculator's display. Reward 1.0 for the right product, else 0.

Why the call takes the question and ``"a."`` the display: a 0.8M-parameter model does not
learn to copy numbers across its context in a warm start of minutes (measured after 2,400
SFT steps: two-digit operands copied into a call 0 % of the time, a 4-digit result copied
back 3-15 %); it recomputes them in its head instead. So the skill RL can teach here is the
decision to use the tool, as with a search tool bound to the task. Why the ``a`` / ``c``
prefixes: the first token is the choice between the two strategies; without them a direct
answer spreads its first token over nine digits and greedy decoding would pick the tool
whenever no digit beats the tool's share, so the warm start's greedy answer would use it.

Why it teaches tool use, not sharpening: the model cannot multiply two-digit numbers in its
head, so its direct answers are mostly wrong beyond level 0, and the warm start (``demo_tool``:
the share of SFT demonstrations that use the tool, 0.3 by default) answers directly most of
the time, so its greedy answer is a guess. Sampled episodes that call the tool are right, and
RL has to make calling it the model's first choice: greedy reward rises only if it does.
Levels: 0 one digit x one digit (learnable by heart), 1 two x one, 2 two x two.

    python -m data.tasks.calculator      # a few rows and demonstrations

The environment (the calculator tool, turns, observations) is ``data/envs/calculator_env.py``.
    python train.py recipe=sft_calculator && python train.py recipe=agent_calculator
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from datasets import Dataset

from data.tasks import level_weights
from modules.config.errors import check

# (digits of a, digits of b) per level
LEVELS: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (2, 2))
ANSWER = re.compile(r"^a(\d*)\.$")


def number(rng: random.Random, digits: int) -> int:
    return rng.randint(2 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def guess(value: int, rng: random.Random) -> int:
    """What answering in one's head gives: the last digit right, the rest off by a little."""
    if value < 10:
        return value
    return max(0, value + 10 * rng.choice((-2, -1, 1, 2)))


@dataclass
class CalculatorTask:
    """Rows and the one-turn reward (the final answer). Every split is a pure function of the seed."""

    level_weights: tuple[float, ...] = (0.3, 0.4, 0.3)
    demo_tool: float = 0.3  # share of SFT demonstrations that call the calculator
    demo_right: float = 0.5  # share of direct (no tool) demonstrations beyond level 0 that are right
    seed: int = 0
    name: str = "calculator"

    def __post_init__(self) -> None:
        self.level_weights = level_weights(self.level_weights, len(LEVELS))
        check("task.demo_tool", self.demo_tool, 0.0 <= self.demo_tool <= 1.0, "a float in [0, 1]")
        check("task.demo_right", self.demo_right, 0.0 <= self.demo_right <= 1.0, "a float in [0, 1]")

    def build(self, split: str, size: int, level_weights: tuple[float, ...] | None = None) -> Dataset:
        offsets = {"train": 0, "eval": 1, "sft": 2}
        if split not in offsets:
            raise ValueError(f"split={split!r}: must be one of {', '.join(offsets)}")
        rng = random.Random(self.seed * 1000 + 500 + offsets[split])
        weights = self.level_weights if level_weights is None else tuple(level_weights)
        rows = []
        for i, level in enumerate(rng.choices(range(len(LEVELS)), weights=weights, k=size)):
            da, db = LEVELS[level]
            a, b = number(rng, da), number(rng, db)
            row: dict[str, Any] = {"id": i, "prompt": f"{a}*{b}?", "answer": str(a * b), "level": level}
            if split == "sft":
                row["demo"] = self.demonstrate(a, b, level, rng)
            rows.append(row)
        return Dataset.from_list(rows)

    def demonstrate(self, a: int, b: int, level: int, rng: random.Random) -> list[str]:
        """A demonstration episode as its turns, the model's and the calculator's alternating
        (the observation ``"{a*b};"`` is trained as context only: data/sft_data.py)."""
        if rng.random() < self.demo_tool:
            return ["c=", f"{a * b};", "a."]
        right = level == 0 or rng.random() < self.demo_right
        return [f"a{a * b if right else guess(a * b, rng)}."]

    def prompt_text(self, row: dict) -> str:
        return row["prompt"]

    def reward(self, row: dict, response: str) -> float:
        """The episode's text scored as the environment scores it: every ``=`` ends a call, the
        calculator's observation follows up to ``;`` (``"error"`` shows nothing), and the text
        after the last observation is the final answer (``"a."``: the result shown)."""
        shown, rest = None, response.strip()
        while "=" in rest:
            _, _, rest = rest.partition("=")
            observation, sep, rest = rest.partition(";")
            if not sep:
                return 0.0  # cut inside an observation: no final answer
            shown = None if observation == "error" else observation
        return float(answer(rest, shown) == row["answer"])


def answer(turn: str, shown: str | None) -> str | None:
    """The number a final turn answers: ``"a1786."`` -> ``"1786"``; ``"a."`` -> the calculator's
    last result (``shown``); anything else is no answer."""
    match = ANSWER.match(turn.strip())
    if match is None:
        return None
    return match[1] or shown


if __name__ == "__main__":
    task = CalculatorTask()
    for row in task.build("sft", 8):
        print(row)
