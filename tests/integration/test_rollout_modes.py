"""Rollout-mode semantics on the simulated virtual-clock engine (modules/engine/sim.py).

The fake engine is a fixture for exact timing; the same controllers drive vLLM in training.
"""

from __future__ import annotations

import pytest

from data.rollout.controller import RewardError, RolloutContext
from data.rollout.prompts import PromptStream
from data.rollout.sync import SyncRollout
from modules.algo.advantages import GroupAdvantage
from modules.engine import SamplingConfig
from modules.engine.sim import CharTokenizer, SimEngine

SAMPLING = SamplingConfig(max_tokens=1000)


def test_a_hanging_reward_times_out():
    from tests.helpers import ScriptedRewardTask  # picklable: rewards with a timeout run in a process

    eng = SimEngine()
    task = ScriptedRewardTask([3, 5], hang=(0, 1))
    ctl = SyncRollout(1, 1, SAMPLING)
    ctl.bind(RolloutContext(eng, task, CharTokenizer(), PromptStream(task.rows), GroupAdvantage()))
    ctl.configure_rewards("fail", timeout_s=0.2)
    try:
        with pytest.raises(RewardError, match="reward_timeout_s"):
            ctl.next_batch()
        ctl.configure_rewards("zero", timeout_s=0.2)
        assert ctl.next_batch()[0].reward == 0.0 and ctl.reward_error_count == 1
    finally:
        ctl.close()  # stops the reward worker processes
