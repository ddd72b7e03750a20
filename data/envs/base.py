"""Multi-turn environments: what an episode is, beside the one-turn ``Task``.

An episode starts from a task's prompt (``Task.prompt_text(row)``); the model writes a turn,
the environment answers with an observation (a tool's output, feedback) and a reward, and says
whether the episode is done. The rollout keeps the history as token ids (``episodes.py``): the
model's tokens exactly as the engine sampled them, each observation tokenised once and
appended, masked out of the loss. A ``Task`` is the one-turn case (``SingleTurn``).

Writing one: subclass ``Environment``, implement ``reset`` (the episode's state from a dataset
row) and ``step`` (the model's turn -> ``Step``), and point ``conf/env/<name>.yaml``'s
``_target_`` at it. Tools go through ``self.tools`` (``tools.py``: concurrency limit, timeout,
retries, a latency model); an exception there becomes an observation, never a crash.

    class Echo(Environment):
        async def reset(self, row):  return {"row": row}
        async def step(self, state, turn):  return Step(observation=turn.upper(), done=True)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from data.envs.tools import ToolRunner
from modules.config.errors import check


@dataclass
class Step:
    """The environment's answer to one model turn."""

    observation: str = ""  # appended to the context (tokenised once), not trained on
    reward: float = 0.0  # summed over the episode's steps
    done: bool = False
    # in the turn records; two keys are counted (turn_stats): "valid_call" (the turn was a tool
    # call, well formed or not) and "tool_error" (a well-formed call the tool failed)
    info: dict[str, Any] = field(default_factory=dict)


def turn_stats(episodes: list[list[dict]]) -> dict[str, float]:
    """Per-episode turn statistics from the turn records of some episodes: turns and tool calls
    per episode, the share of calls that were well formed (``valid_call_rate``) and of
    well-formed calls the tool failed (``tool_error_rate``); a rate only where it has calls."""
    if not episodes:
        return {}
    n = len(episodes)
    calls = [t for turns in episodes for t in turns if "valid_call" in t or "tool_error" in t]
    out = {"turns": sum(map(len, episodes)) / n, "tool_calls": len(calls) / n}
    attempts = [bool(t["valid_call"]) for t in calls if "valid_call" in t]
    if attempts:
        out["valid_call_rate"] = sum(attempts) / len(attempts)
    ran = [bool(t["tool_error"]) for t in calls if "tool_error" in t and t.get("valid_call", True)]
    if ran:
        out["tool_error_rate"] = sum(ran) / len(ran)
    return out


class Environment(ABC):
    """Base class of a multi-turn environment (one instance serves every episode of a run).

    ``stop``: strings that end the model's turn (the engine stops after the token that ends
    one; with a character tokenizer, one character). ``max_turns``: model turns per episode;
    ``max_turn_tokens``: tokens per model turn (a turn cut there is answered like any other);
    ``max_total_tokens``: the episode's tokens after the prompt, model and observation alike
    (what ``rollout.sampling.max_tokens`` is for a one-turn task). A turn that the model ends
    with EOS ends the episode (the environment scores it)."""

    def __init__(
        self,
        max_turns: int = 4,
        max_total_tokens: int | None = None,
        stop: tuple[str, ...] | list[str] = (),
        tools: ToolRunner | None = None,
        max_turn_tokens: int | None = None,
    ) -> None:
        check("env.max_turns", max_turns, isinstance(max_turns, int) and max_turns >= 1, "an int >= 1")
        check(
            "env.max_total_tokens",
            max_total_tokens,
            max_total_tokens is None or (isinstance(max_total_tokens, int) and max_total_tokens >= 1),
            "null (rollout.sampling.max_tokens) or an int >= 1",
        )
        check(
            "env.stop",
            stop,
            all(isinstance(s, str) and s for s in stop),
            "a list of non-empty strings",
        )
        check(
            "env.max_turn_tokens",
            max_turn_tokens,
            max_turn_tokens is None or (isinstance(max_turn_tokens, int) and max_turn_tokens >= 1),
            "null (no cap but the episode's) or an int >= 1",
        )
        self.max_turn_tokens = max_turn_tokens
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.stop = tuple(stop)
        self.tools = tools if tools is not None else ToolRunner()

    async def reset(self, row: dict) -> Any:
        """The state of a new episode on dataset row ``row`` (passed back to every ``step``)."""
        return {"row": row}

    @abstractmethod
    async def step(self, state: Any, turn: str) -> Step:
        """The answer to the model's turn ``turn`` (its decoded text)."""

    def final_reward(self, state: Any, rewards: list[float], truncated: bool) -> float:
        """The episode's reward from its steps' rewards (their sum; an episode cut by the
        token budget, ``truncated``, or ended by ``max_turns``, not truncated, keeps what it
        earned)."""
        return float(sum(rewards))

    def close(self) -> None:
        self.tools.close()


class SingleTurn(Environment):
    """A ``Task`` as a one-turn environment: the response is scored and the episode ends."""

    def __init__(self, task: Any) -> None:
        super().__init__(max_turns=1)
        self.task = task

    async def step(self, state: Any, turn: str) -> Step:
        return Step(reward=float(self.task.reward(state["row"], turn)), done=True)
