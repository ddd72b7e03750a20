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

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from data.envs.stops import Stops
from data.envs.tools import ToolRunner
from modules.config.errors import ConfigError, check


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


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def episode_budget(max_total_tokens: int | None, max_tokens: int) -> tuple[int, str]:
    """An episode's token budget after its prompt and the field that sets it: ``env.max_total_tokens``,
    or ``rollout.sampling.max_tokens`` when that is null."""
    if max_total_tokens is not None:
        return max_total_tokens, "env.max_total_tokens"
    return max_tokens, "rollout.sampling.max_tokens"


def episode_fits_engine(cfg: Any) -> None:
    """Cross-field rule of every environment: the episode's token budget (``env.max_total_tokens``,
    or ``rollout.sampling.max_tokens``) leaves room for a prompt within ``engine.max_model_len``,
    and a model turn (``env.max_turn_tokens``) fits in the episode. The longest prompt of the task
    is checked against the budget when the run starts (``RolloutDataModule.preflight``)."""
    env, mml = cfg.env, cfg.engine.max_model_len
    budget, field = episode_budget(env.get("max_total_tokens"), cfg.rollout.sampling.max_tokens)
    if isinstance(budget, int) and isinstance(mml, int):
        check(
            field,
            budget,
            budget + 16 <= mml,
            f"an int that leaves room for the prompt within engine.max_model_len={mml}",
        )
    turn = env.get("max_turn_tokens")
    if isinstance(turn, int) and isinstance(budget, int):
        check(
            "env.max_turn_tokens",
            turn,
            turn <= budget,
            f"null or an int <= the episode's budget {field}={budget}",
        )


def stop_token_ids(tokenizer: Any, stops: tuple[str, ...]) -> tuple[int, ...]:
    """The token id of each ``env.stop`` string, each of which must be one token: the rule of
    TRL's rollout hook (``tools/trl_episodes.py``), which stops ``generate`` on token ids; the
    episode runner also takes stops of several tokens (``data/envs/stops.py``)."""
    ids = []
    for s in stops:
        tokens = tokenizer(s, add_special_tokens=False)["input_ids"]
        if len(tokens) != 1:
            raise ConfigError(
                f"invalid config value env.stop={list(stops)!r}: must be strings of one token each "
                f"for this tokenizer ({s!r} is {len(tokens)} tokens)"
            )
        ids.append(int(tokens[0]))
    return tuple(ids)


def check_episodes_fit(
    env: Any, tokenizer: Any, longest: int, max_tokens: int, max_model_len: int | None
) -> None:
    """Start-up check with the tokenizer: each ``env.stop`` is text the tokenizer can produce
    (``data/envs/stops.py``), and the longest prompt (``longest`` tokens) plus the episode's
    budget fits ``engine.max_model_len`` (so no turn's context overflows)."""
    Stops(tokenizer, env.stop)
    budget, field = episode_budget(env.max_total_tokens, max_tokens)
    if max_model_len is not None:
        allowed = f"an int <= engine.max_model_len={max_model_len} - {longest} (the task's longest prompt)"
        check(field, budget, longest + budget <= max_model_len, allowed)


class Environment(ABC):
    """Base class of a multi-turn environment (one instance serves every episode of a run).

    ``stop``: strings that end the model's turn, kept in it (one token: the character model's
    ``=``; or several: a chat model's ``</tool_call>``; ``stops.py``). ``max_turns``: model turns per episode;
    ``max_turn_tokens``: tokens per model turn (a turn cut there is answered like any other);
    ``max_total_tokens``: the episode's tokens after the prompt, model and observation alike
    (what ``rollout.sampling.max_tokens`` is for a one-turn task). A turn that the model ends
    with EOS ends the episode (the environment scores it)."""

    # Rules relating this environment to other config groups (``modules/launch/validate.py``).
    cross_field_rules: ClassVar[tuple[Callable[[Any], None], ...]] = (episode_fits_engine,)

    def __init__(
        self,
        max_turns: int = 4,
        max_total_tokens: int | None = None,
        stop: tuple[str, ...] | list[str] = (),
        tools: ToolRunner | None = None,
        max_turn_tokens: int | None = None,
        call_timeout_s: float = 60.0,
        episode_timeout_s: float | None = 600.0,
        workers: int = 16,
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
        check("env.call_timeout_s", call_timeout_s, _positive(call_timeout_s), "a finite float > 0 (seconds)")
        check(
            "env.episode_timeout_s",
            episode_timeout_s,
            episode_timeout_s is None or _positive(episode_timeout_s),
            "null (no deadline) or a finite float > 0 (seconds in environment calls per episode)",
        )
        check("env.workers", workers, isinstance(workers, int) and workers >= 1, "an int >= 1 (threads)")
        self.call_timeout_s = float(call_timeout_s)
        self.episode_timeout_s = None if episode_timeout_s is None else float(episode_timeout_s)
        self.workers = workers
        self.max_turn_tokens = max_turn_tokens
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.stop = tuple(stop)
        self.tools = tools if tools is not None else ToolRunner()

    async def reset(self, row: dict, seed: int | None = None) -> Any:
        """The state of a new episode on dataset row ``row`` (passed back to every ``step``);
        ``seed`` is distinct per episode (an override that does not take it gets none)."""
        return {"row": row}

    @abstractmethod
    async def step(self, state: Any, turn: str) -> Step:
        """The answer to the model's turn ``turn`` (its decoded text)."""

    def final_reward(self, state: Any, rewards: list[float], truncated: bool) -> float:
        """The episode's reward from its steps' rewards (their sum; an episode cut by the
        token budget, ``truncated``, or ended by ``max_turns``, not truncated, keeps what it
        earned)."""
        return float(sum(rewards))

    def cleanup(self, state: Any, reason: str) -> None:
        """Called once for every episode that ``reset`` started, however it ends: ``reason`` is
        ``done``, ``truncated``, ``error``, ``cancelled`` (its group was cancelled or dropped
        while generating) or ``teardown`` (the run stopped, e.g. after a checkpoint re-queued its
        prompt). Free what ``reset`` took (a sandbox, a container, a connection) here. May be a
        coroutine; runs off the episode loop, bounded by ``call_timeout_s``."""
        return None

    def close(self) -> None:
        self.tools.close()


class SingleTurn(Environment):
    """A ``Task`` as a one-turn environment: the response is scored and the episode ends."""

    def __init__(self, task: Any) -> None:
        super().__init__(max_turns=1)
        self.task = task

    async def reset(self, row: dict, seed: int | None = None) -> Any:
        return {"row": row}

    async def step(self, state: Any, turn: str) -> Step:
        return Step(reward=float(self.task.reward(state["row"], turn)), done=True)
