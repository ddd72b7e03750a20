"""Arithmetic word problems from templates, at three levels: the single-turn task of the real
chat model (``recipe=smollm2_grpo``), GSM8K's shape at a size a 135M model can learn on a CPU.

    python -m data.tasks.word_problems      # print a few problems per level

Level 0 is one addition or subtraction of one-digit numbers ("Mia has 6 shells and finds 7
more..."); level 1 a product of two one-digit numbers ("4 boxes with 7 shells in each box");
level 2 one addition or subtraction of two-digit numbers. Greedy, the imported model starts at
0.38 / 0.21 / 0.00 on the 96 held-out problems of seed 0 (lab/README.md). The numbers,
names and objects are drawn per row from a seed, each split its own, and the splits are
disjoint by question text: a question belongs to the held-out side when a hash of its text
falls in a fixed fifth of the hash space (``held_out``), so ``eval`` draws only such questions
and ``train`` / ``sft`` never do, at every size and seed. The arithmetic itself is shared
(level 1 has only 64 products): the held-out set tests new wordings of known sums, not unseen
sums.

Reward: 1.0 when the response's final answer equals the reference, else 0.0. The final answer
is the last number the response writes (``#### 42``, ``\\boxed{42}``, "The answer is 42." all
count; "42 apples" too), compared by math-verify (``data/tasks/verify.py``). There is no format
reward: a response that ends with a restatement of another number ("...so 71 in all, from 23
and 48") is scored on the 48, so RL teaches the model to end with its answer as a by-product.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from data.tasks import level_weights as checked_weights
from data.tasks import split_rng
from data.tasks.gsm8k import answers_match
from modules.config.errors import check

NAMES = ("Mia", "Sam", "Leo", "Ava", "Noah", "Emma", "Liam", "Zoe", "Omar", "Lina", "Ivan", "Rosa")
THINGS = ("apples", "shells", "stickers", "marbles", "books", "coins", "cards", "pencils", "stamps", "beads")
INSTRUCTION = "Answer with the final number."
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


def _level0(rng: random.Random, who: str, what: str) -> tuple[str, int]:
    """One step with one-digit numbers: a sum, or a difference from a number below 20."""
    if rng.random() < 0.5:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"{who} has {a} {what} and finds {b} more. How many {what} does {who} have now?", a + b
    a, b = rng.randint(10, 19), rng.randint(2, 9)
    return f"{who} has {a} {what} and gives away {b}. How many {what} does {who} have left?", a - b


def _level1(rng: random.Random, who: str, what: str) -> tuple[str, int]:
    """A product of two one-digit numbers, in boxes."""
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"{who} buys {a} boxes with {b} {what} in each box. How many {what} does {who} buy?", a * b


def _level2(rng: random.Random, who: str, what: str) -> tuple[str, int]:
    """One step with two-digit numbers: a sum or a difference."""
    a, b = rng.randint(11, 89), rng.randint(11, 89)
    if rng.random() < 0.5:
        return f"{who} has {a} {what} and finds {b} more. How many {what} does {who} have now?", a + b
    a, b = max(a, b), min(a, b)
    return f"{who} has {a} {what} and gives away {b}. How many {what} does {who} have left?", a - b


LEVELS = (_level0, _level1, _level2)
HELD_OUT_SHARE = 51 / 256  # the fifth of the question space only the eval split draws from


def held_out(question: str) -> bool:
    """Whether ``question`` belongs to the held-out side of the split (stable across runs)."""
    return hashlib.sha256(question.encode()).digest()[0] < round(HELD_OUT_SHARE * 256)


def draw_in_split(draw: Callable[[], tuple], split: str) -> tuple:
    """``draw()`` until its question (the first element) lies on ``split``'s side of
    ``held_out``: ``eval`` takes only held-out questions, ``train`` / ``sft`` never."""
    while True:
        drawn = draw()
        if held_out(drawn[0]) == (split == "eval"):
            return drawn


def final_number(response: str) -> str | None:
    """The last number written in ``response`` (commas dropped), or None."""
    numbers = re.findall(_NUMBER, response)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


@dataclass
class WordProblemsTask:
    level_weights: tuple[float, ...] | list[float] = (1.0, 1.0, 1.0)
    seed: int = 0
    name: str = "word_problems"

    def __post_init__(self) -> None:
        self.level_weights = checked_weights(self.level_weights, len(LEVELS))
        check("task.seed", self.seed, isinstance(self.seed, int), "an int")

    def build(self, split: str, size: int, level_weights: tuple[float, ...] | None = None) -> list[dict]:
        """``size`` rows of ``split`` (``train`` / ``eval`` / ``sft``), each split its own seed,
        ``eval`` disjoint from the others by question text."""
        rng = split_rng(split, self.seed, salt=77)
        weights = self.level_weights if level_weights is None else tuple(level_weights)
        rows = []
        for i in range(size):
            level = rng.choices(range(len(LEVELS)), weights=weights)[0]
            question, answer = draw_in_split(  # redrawn within the level
                lambda level=level: LEVELS[level](rng, rng.choice(NAMES), rng.choice(THINGS)), split
            )
            rows.append({"id": i, "level": level, "question": question, "answer": str(answer)})
        return rows

    def prompt_text(self, row: dict) -> str:
        return f"{row['question']} {INSTRUCTION}"

    def reward(self, row: dict, response: str) -> float:
        return 1.0 if answers_match(final_number(response), row["answer"]) else 0.0


if __name__ == "__main__":
    task = WordProblemsTask()
    for row in task.build("train", 6, level_weights=(1, 1, 1)):
        print(row["level"], task.prompt_text(row), "->", row["answer"])
