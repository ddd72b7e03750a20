"""Test-only helpers: a task whose reward varies for an untrained model.

The remainder task's reward is 0 for a random model, so every GRPO advantage would be 0 and
the weights would never change; end-to-end tests swap in this task
(``task._target_=tests.helpers.DigitShareTask``) so updates and syncs are real.
"""

from __future__ import annotations

from data.envs.base import Step
from data.envs.calculator_env import CalculatorEnv
from data.tasks.remainder import RemainderTask


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


class HangingRewardTask(RemainderTask):
    """Reward function that never returns, to test ``data.reward_timeout_s`` end to end."""

    def reward(self, row: dict, response: str) -> float:
        import time

        while True:
            time.sleep(60)


class ScriptedRewardTask:
    """Reward-runner fixture: rows for the simulated engine (prompt ``"<length>|"``, as
    ``modules.engine.sim.SimTask``) whose reward misbehaves on chosen prompt ids.

    ``hang``: sleeps forever; ``hang_child``: starts a ``sleep`` subprocess, then hangs;
    ``fail``: raises ``ValueError``; ``odd_fail``: raises an exception that cannot be
    unpickled; ``crash``: exits the process. Any other id scores ``id % 3 == 0``, like SimTask.
    Defined at module level (and holding only plain data) so a reward worker can unpickle it.
    """

    def __init__(
        self,
        lengths: list[int],
        hang: tuple[int, ...] = (),
        hang_child: tuple[int, ...] = (),
        fail: tuple[int, ...] = (),
        odd_fail: tuple[int, ...] = (),
        crash: tuple[int, ...] = (),
    ) -> None:
        self.rows = [{"id": i, "length": n, "level": int(n >= 50)} for i, n in enumerate(lengths)]
        self.hang, self.hang_child = set(hang), set(hang_child)
        self.fail, self.odd_fail, self.crash = set(fail), set(odd_fail), set(crash)

    def prompt_text(self, row: dict) -> str:
        return f"{row['length']}|"

    def reward(self, row: dict, response: str) -> float:
        import os
        import subprocess
        import time

        i = row["id"]
        if i in self.hang_child:
            subprocess.Popen(["sleep", "600"])
        if i in self.hang or i in self.hang_child:
            while True:
                time.sleep(60)
        if i in self.fail:
            raise ValueError(f"verifier crashed on prompt {i}")
        if i in self.odd_fail:
            raise UnpicklableRewardError("grader", i)
        if i in self.crash:
            os._exit(3)
        return float(i % 3 == 0)


class UnpicklableRewardError(Exception):
    """Pickles but cannot be unpickled (``__init__`` takes two arguments, ``args`` holds one)."""

    def __init__(self, who: str, prompt: int) -> None:
        super().__init__(f"{who} rejected prompt {prompt}")


class UnpicklableTask(ScriptedRewardTask):
    """Holds a lock, so it cannot be copied into a reward worker process."""

    def __init__(self, lengths: list[int]) -> None:
        import threading

        super().__init__(lengths)
        self.lock = threading.Lock()


class EveryTurnAnswered(CalculatorEnv):
    """The calculator environment's settings, but every model turn is answered with
    ``"<its length>;"`` and a reward of 0.25 until ``max_turns`` (a random model rarely writes
    a stop token: its turns end at ``max_turn_tokens``): multi-turn episodes on any model."""

    async def step(self, state: dict, turn: str) -> Step:
        return Step(observation=f"{len(turn)};", reward=0.25)


class SigtermAtEvaluationTask(DigitShareTask):
    """Sends SIGTERM to its own (trainer) process the first time it scores a held-out row:
    a scheduler's stop that lands during the evaluation before the first step."""

    def build(self, split: str, size: int, level_weights=None):
        rows = super().build(split, size, level_weights)
        return rows.map(lambda row: {"held_out": split == "eval"})

    def reward(self, row: dict, response: str) -> float:
        import os
        import signal

        if row.get("held_out") and not getattr(SigtermAtEvaluationTask, "sent", False):
            SigtermAtEvaluationTask.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return super().reward(row, response)


class StepFailsOnOddPrompts(EveryTurnAnswered):
    """``EveryTurnAnswered``, but ``step`` raises on prompts with an odd id: an environment bug
    that must stop the run (data.reward_errors=fail) or be counted (zero), never a silent 0."""

    async def step(self, state: dict, turn: str) -> Step:
        if state["row"]["id"] % 2:
            raise ValueError("a bug in the environment")
        return await super().step(state, turn)
