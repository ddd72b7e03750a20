"""Rewards with a timeout run in killable worker processes (data/rollout/rewards.py).

No vLLM: the runner is driven directly, and through a controller on the simulated engine.
Each worker is a fresh interpreter (about a second to start here), so tests share what they can.
"""

from __future__ import annotations

import time

import psutil
import pytest

from data.rollout.controller import RewardError, RolloutContext
from data.rollout.prompts import PromptStream
from data.rollout.rewards import (
    RemoteRewardError,
    RemoteTraceback,
    RewardRunner,
    RewardTimeout,
    RewardWorkerDied,
    RewardWorkerError,
)
from data.rollout.streaming import StreamingRollout
from data.rollout.sync import SyncRollout
from modules.algo.advantages import GroupAdvantage
from modules.engine import SamplingConfig
from modules.engine.sim import CharTokenizer, SimEngine
from tests.helpers import ScriptedRewardTask

TIMEOUT_S = 0.5

SAMPLING = SamplingConfig(max_tokens=1000)


def children() -> set[int]:
    """This process's descendants, less multiprocessing's resource tracker: one per process,
    started by the first "spawn" of anything (vLLM and torch start it too), shared by every
    later one, and gone when this process exits; it is not a reward worker."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "multiprocessing.resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def gone(pids: list[int]) -> bool:
    """Exited and reaped (a zombie would still count as left behind)."""
    return not any(psutil.pid_exists(pid) for pid in pids)


def controller(task: ScriptedRewardTask, on_error: str, ctl=None):
    ctl = ctl or SyncRollout(len(task.rows), 1, SAMPLING)
    ctl.configure_rewards(on_error, timeout_s=TIMEOUT_S)
    ctl.bind(RolloutContext(SimEngine(), task, CharTokenizer(), PromptStream(task.rows), GroupAdvantage()))
    return ctl


def test_a_hanging_reward_is_killed_and_a_fresh_worker_scores_the_next_call():
    before = children()
    task = ScriptedRewardTask([3, 5, 4], hang_child=(1,))
    runner = RewardRunner(task, TIMEOUT_S)
    try:
        assert runner(task.rows[0], "") == 1.0  # waits for start-up, not charged to the timeout
        (old,) = runner.pids
        t0 = time.monotonic()
        with pytest.raises(RewardTimeout, match=r"data\.reward_timeout_s=0\.5 s"):
            runner(task.rows[1], "")
        assert time.monotonic() - t0 < TIMEOUT_S + 3  # timeout plus terminate, not forever
        assert gone([old])
        (new,) = runner.pids
        assert new != old and runner.restarts == 1
        # the `sleep` the hung reward started went with its worker
        assert children() - before == {new}
        assert [runner(r, "") for r in task.rows if r["id"] != 1] == [1.0, 0.0]
    finally:
        runner.close()
    assert gone([new]) and children() <= before
    runner.close()  # twice is fine
    with pytest.raises(RewardWorkerError, match="closed"):
        runner(task.rows[0], "")


def test_rewards_in_workers_equal_the_inline_values_and_errors_keep_their_message():
    task = ScriptedRewardTask(list(range(1, 13)), fail=(4,), odd_fail=(5,), crash=(7,))
    runner = RewardRunner(task, 5.0)
    try:
        normal = [r for r in task.rows if r["id"] not in (4, 5, 7)]
        assert [runner(r, "text") for r in normal] == [task.reward(r, "text") for r in normal]
        with pytest.raises(ValueError, match="verifier crashed on prompt 4") as err:
            runner(task.rows[4], "")
        assert isinstance(err.value.__cause__, RemoteTraceback)
        assert "in reward" in str(err.value.__cause__)  # the worker's traceback comes along
        with pytest.raises(RemoteRewardError, match="UnpicklableRewardError: grader rejected prompt 5"):
            runner(task.rows[5], "")
        assert runner.restarts == 0  # a raising reward leaves its worker usable
        with pytest.raises(RewardWorkerDied, match="exit code 3"):
            runner(task.rows[7], "")
        assert runner.restarts == 1 and runner(task.rows[0], "") == 1.0
    finally:
        runner.close()


def test_zero_policy_counts_timeouts_and_later_calls_still_score():
    before = children()
    task = ScriptedRewardTask([3, 5, 4, 6], hang=(1,))
    ctl = controller(task, "zero")
    try:
        for epoch in (1, 2):  # each batch holds every prompt once: one timeout per batch
            rewards = {e.prompt_id: e.reward for e in ctl.next_batch()}
            assert rewards == {0: 1.0, 1: 0.0, 2: 0.0, 3: 1.0}
            assert ctl.reward_error_count == epoch
        pids = ctl._rewards.pids
    finally:
        ctl.close()
    assert gone(pids) and children() <= before


def test_fail_policy_raises_naming_the_prompt_and_the_timeout():
    task = ScriptedRewardTask([3, 5], hang=(1,))
    ctl = controller(task, "fail")
    try:
        with pytest.raises(RewardError, match=r"prompt id 1: .*data\.reward_timeout_s=0\.5 s"):
            ctl.next_batch()
    finally:
        ctl.close()


def test_fail_policy_reports_what_the_reward_raised():
    task = ScriptedRewardTask([3, 5], fail=(0,))
    ctl = controller(task, "fail")
    try:
        with pytest.raises(RewardError, match="prompt id 0: ValueError.*verifier crashed on prompt 0"):
            ctl.next_batch()
    finally:
        ctl.close()


def test_streaming_close_stops_the_workers():
    before = children()
    task = ScriptedRewardTask([3, 5, 4, 6])
    ctl = controller(task, "fail", StreamingRollout(2, 1, SAMPLING, max_inflight=4))
    assert [e.reward for e in ctl.next_batch()]
    pids = ctl._rewards.pids
    ctl.close()
    assert gone(pids) and children() <= before
