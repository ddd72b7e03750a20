"""MATH recipe, offline: boxed extraction, answer equivalence, prompt format and reward on the
bundled examples, hub loading with a stand-in ``load_dataset``; the recipe composes and
validates. ``make install`` installs math-verify: the tests marked ``needs_math_verify`` run the
real library (and skip without it); every other test passes with and without it, and the
fallback (the normalised comparison alone) is tested with the import made to fail."""

from __future__ import annotations

import json

import pytest

from data.rollout.rewards import RewardRunner
from data.tasks.math import (
    EXAMPLES,
    MathTask,
)

try:
    import math_verify  # noqa: F401

    HAVE_MATH_VERIFY = True
except ImportError:
    HAVE_MATH_VERIFY = False

needs_math_verify = pytest.mark.skipif(
    not HAVE_MATH_VERIFY, reason="math-verify not installed (make install)"
)


def _examples() -> list[tuple[dict, dict]]:
    raw = [json.loads(line) for line in EXAMPLES.read_text().splitlines() if line.strip()]
    return list(zip(MathTask(offline=True).build("train", 100), raw))


@needs_math_verify
def test_reward_in_a_reward_worker_process():
    """``data.reward_timeout_s`` (the math_grpo recipe sets it) scores in a spawned worker
    process: math-verify runs there too, on forms only it accepts."""
    task = MathTask(offline=True)
    rows = {row["answer"]: row for row, _ in _examples()}
    runner = RewardRunner(task, timeout_s=120)
    try:
        assert runner(rows["2, 3"], r"\boxed{3, 2}") == 1.0  # reordered: math-verify only
        assert runner(rows[r"2\sqrt{2}"], r"\boxed{\sqrt{8}}") == 1.0
        assert runner(rows[r"2\sqrt{2}"], r"\boxed{\sqrt{7}}") == 0.0
        assert runner(rows["(-2, 2)"], r"\boxed{(-2, 2)}") == 1.0
    finally:
        runner.close()
