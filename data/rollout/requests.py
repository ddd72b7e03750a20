"""What a rollout controller works with: its context (engine, task, tokenizer, prompt stream,
advantage, episodes) and one request in flight (``Pending``), carried over an abort."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from data.rollout.prompts import PromptStream
from modules.engine.types import Engine
from modules.policy.prompt_format import PlainText


@dataclass
class RolloutContext:
    """Everything a controller needs, handed over by the datamodule once the engine is up."""

    engine: Engine
    task: Any  # data.tasks.Task
    tokenizer: Any
    prompts: PromptStream
    advantage: Any  # modules.algo.advantages: GroupAdvantage (rewards of a group) or RunningBaseline
    seed: int = 0
    episodes: Any = None  # data.envs.episodes.EpisodeRunner with a multi-turn env (env=...), else None
    prompt_format: Any = field(default_factory=PlainText)  # model.prompt_format: text -> prompt ids

    def prompt_ids(self, row: dict) -> list[int]:
        """The ids the engine completes for ``row`` (``modules/policy/prompt_format.py``)."""
        return self.prompt_format.ids(self.tokenizer, self.task.prompt_text(row))


@dataclass
class Pending:
    """A submitted request and what it belongs to.

    A request aborted at a weight sync is resubmitted as prompt + partial response; the
    ``prefix_*`` fields carry what was generated before, so tokens, behaviour logprobs and
    version spans stay aligned across the split.
    """

    row: dict
    group_id: int
    sample_index: int
    seed: int
    policy_version: int  # engine version when the first token was requested
    prompt_ids: list[int] = field(default_factory=list)
    prefix_ids: list[int] = field(default_factory=list)
    prefix_logprobs: list[float] = field(default_factory=list)
    prefix_spans: list[tuple[int, int, int]] = field(default_factory=list)
    splits: int = 0
    gen_start: float | None = None
    prefix_mask: list[int] = field(default_factory=list)  # 0: an observation token (episodes)
    episode: Any = None  # an aborted episode's state (data.envs.episodes.EpisodeState)


def merge_spans(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Join adjacent spans of the same version: [(3,0,4),(3,4,9)] -> [(3,0,9)]."""
    out: list[tuple[int, int, int]] = []
    for v, s, e in spans:
        if e <= s:
            continue
        if out and out[-1][0] == v and out[-1][2] == s:
            out[-1] = (v, out[-1][1], e)
        else:
            out.append((v, s, e))
    return out
