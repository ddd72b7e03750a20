"""GSM8K recipe, offline: prompt format and reward on the bundled examples (with the real
math-verify, and with its fallback); the reward on another thread and in a reward worker; the
recipe composes."""

from __future__ import annotations

import threading

from data.rollout.rewards import RewardRunner
from data.tasks.gsm8k import GSM8KTask

try:
    import math_verify  # noqa: F401

    HAVE_MATH_VERIFY = True
except ImportError:
    HAVE_MATH_VERIFY = False


def test_reward_off_the_main_thread_and_in_a_reward_worker():
    """Rewards are scored on the engine's callback thread (inline) or, with
    data.reward_timeout_s (the gsm8k_grpo recipe sets it), in a spawned worker process."""
    task = GSM8KTask(offline=True)
    rows = task.build("train", 10)
    responses = [(rows[0], "#### 72"), (rows[1], "\\boxed{10.0}"), (rows[2], "#### 6")]
    out: list[list[float]] = []
    thread = threading.Thread(target=lambda: out.append([task.reward(r, t) for r, t in responses]))
    thread.start()
    thread.join()
    assert out == [[1.0, 1.0, 0.0]]
    runner = RewardRunner(task, timeout_s=120)
    try:
        assert [runner(r, t) for r, t in responses] == [1.0, 1.0, 0.0]
    finally:
        runner.close()
