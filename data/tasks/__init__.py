"""Tasks: where prompts come from and how responses are scored.

    remainder.py   the default task, built by the project (no downloads), long-tailed lengths
    calculator.py  multiplication with a calculator tool: a multi-turn task (``env=calculator``)
    gsm8k.py       GSM8K word problems (hub data; bundled examples for offline tests)
    math.py        MATH competition problems (hub data; bundled examples for offline tests)

A task is any object with the three methods of ``Task``; a recipe selects it with
``task._target_`` (``conf/task/``). A row is a plain dict; ``id`` (an int, unique within a
split) keys the checkpointed prompt stream and the audit files, and ``level`` (optional, an
int difficulty bucket) keys the difficulty metrics (``bias/*``, ``eval/*_level<k>``) and
stratified batches. With ``data.reward_timeout_s`` set, rewards run in a worker process, so
the task must pickle (module-level class, plain data).

A new task for a fork: copy ``remainder.py``, keep the three methods, and point the recipe's
``task._target_`` at the class.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from modules.config.errors import check


@runtime_checkable
class Task(Protocol):
    def build(self, split: str, size: int, level_weights: Sequence[float] | None = None) -> Sequence[dict]:
        """``size`` rows of ``split`` (``train`` / ``eval``; the remainder task also has ``sft``),
        deterministic for a given config; ``level_weights`` overrides the difficulty mix where
        the task has one (the SFT warm start uses it)."""

    def prompt_text(self, row: dict) -> str:
        """The prompt the engine completes (the tokenizer turns it into ids)."""

    def reward(self, row: dict, response: str) -> float:
        """Score of a decoded response; it may raise (``data.reward_errors`` decides)."""


SPLITS = ("train", "eval", "sft")


def split_rng(split: str, seed: int, salt: int) -> random.Random:
    """The random stream of one split of a generated task: each split its own (``train`` and
    ``eval`` never share a stream), a task its own ``salt``."""
    if split not in SPLITS:  # a caller's mistake, not a config value
        raise ValueError(f"split={split!r}: must be one of {', '.join(SPLITS)}")
    return random.Random(seed * 1000 + SPLITS.index(split) + salt)


def level_weights(weights: Sequence[float], levels: int) -> tuple[float, ...]:
    """``task.level_weights`` checked: one non-negative weight per level, not all zero."""
    out = tuple(float(w) for w in weights)
    check(
        "task.level_weights",
        list(out),
        len(out) == levels and min(out) >= 0 and sum(out) > 0,
        f"{levels} non-negative weights, not all zero",
    )
    return out
