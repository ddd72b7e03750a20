"""Test-only helpers: a task whose reward varies for an untrained model.

The remainder task's reward is 0 for a random model, so every GRPO advantage would be 0 and
the weights would never change; end-to-end tests swap in this task
(``task._target_=tests.helpers.DigitShareTask``) so updates and syncs are real.
"""

from __future__ import annotations

from recipes.remainder import RemainderTask


class DigitShareTask(RemainderTask):
    """Reward = share of digits in the response (continuous, varies across samples)."""

    def reward(self, row: dict, response: str) -> float:
        if not response:
            return 0.0
        return sum(c.isdigit() for c in response) / len(response)


class FailingRewardTask(RemainderTask):
    """Reward function that raises, to test that the failure surfaces in the trainer."""

    def reward(self, row: dict, response: str) -> float:
        raise ValueError("reward server unavailable")
