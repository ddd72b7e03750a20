"""Rewards with a timeout run in killable worker processes (data/rollout/rewards.py).

No vLLM: the runner is driven directly, and through a controller on the simulated engine.
Each worker is a fresh interpreter (about a second to start here), so tests share what they can.
"""

from __future__ import annotations

import pytest

from data.rollout.controller import RolloutContext
from data.rollout.prompts import PromptStream
from data.rollout.rewards import (
    RewardRunner,
)
from data.rollout.sync import SyncRollout
from modules.algo.advantages import GroupAdvantage
from modules.config.errors import ConfigError
from modules.engine import SamplingConfig
from modules.engine.sim import CharTokenizer, SimEngine
from tests.helpers import ScriptedRewardTask, UnpicklableTask

TIMEOUT_S = 0.5

SAMPLING = SamplingConfig(max_tokens=1000)


def controller(task: ScriptedRewardTask, on_error: str, ctl=None):
    ctl = ctl or SyncRollout(len(task.rows), 1, SAMPLING)
    ctl.configure_rewards(on_error, timeout_s=TIMEOUT_S)
    ctl.bind(RolloutContext(SimEngine(), task, CharTokenizer(), PromptStream(task.rows), GroupAdvantage()))
    return ctl


def test_a_task_that_cannot_be_pickled_is_a_config_error_naming_task():
    task = UnpicklableTask([3])
    with pytest.raises(ConfigError, match=r"task tests\.helpers\.UnpicklableTask cannot be pickled"):
        RewardRunner(task, TIMEOUT_S)
    with pytest.raises(ConfigError, match="`task`.*data.reward_timeout_s=null"):
        controller(task, "fail")
    ctl = SyncRollout(1, 1, SAMPLING)  # without a timeout the reward runs inline: no copy needed
    ctl.bind(RolloutContext(SimEngine(), task, CharTokenizer(), PromptStream(task.rows), GroupAdvantage()))
    assert ctl.next_batch()[0].reward == 1.0 and ctl._rewards is None
