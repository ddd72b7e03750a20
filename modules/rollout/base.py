"""What every rollout controller shares: prompt stream, request submission, reward, groups.

A controller (sync here; partial and streaming build on the same pieces) asks the engine for
responses and returns complete, advantage-scored groups of ``Experience``. Rewards are
computed as each response finishes, while the rest of the batch is still generating.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import time
from dataclasses import dataclass
from typing import Any

from modules.engine import Completion, SamplingConfig, VLLMEngine
from modules.experience import Experience


class RewardError(RuntimeError):
    """The task's reward function raised; the message names the prompt."""


class PromptStream:
    """Endless shuffled pass over the train split; its cursor is checkpointed."""

    def __init__(self, rows: list[dict], seed: int = 0) -> None:
        self.rows = rows
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 7919 + self.epoch).shuffle(order)
        return order

    def next(self) -> dict:
        if self.cursor >= len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._shuffle()
        row = self.rows[self._order[self.cursor]]
        self.cursor += 1
        return row

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._shuffle()


@dataclass
class RolloutContext:
    """Everything a controller needs, handed over by the datamodule once the engine is up."""

    engine: VLLMEngine
    task: Any
    tokenizer: Any
    prompts: PromptStream
    advantage: Any  # callable: list of G rewards -> list of G advantages
    seed: int = 0


@dataclass
class Pending:
    """A submitted request and what it belongs to."""

    row: dict
    group_id: int
    sample_index: int
    seed: int
    policy_version: int


class RolloutController:
    """Base class: request bookkeeping shared by the rollout modes."""

    def __init__(self, prompts_per_step: int, group_size: int, sampling: SamplingConfig) -> None:
        from modules.config_errors import check

        check(
            "rollout.prompts_per_step",
            prompts_per_step,
            isinstance(prompts_per_step, int) and prompts_per_step >= 1,
            "an int >= 1",
        )
        check(
            "rollout.group_size", group_size, isinstance(group_size, int) and group_size >= 1, "an int >= 1"
        )
        check(
            "rollout.sampling.temperature",
            sampling.temperature,
            sampling.temperature > 0,
            "a float > 0 (training samples need a proper distribution)",
        )
        # The trainer recomputes logprobs as log_softmax(logits / T); truncated distributions
        # (top-p / top-k) would make behaviour and trainer logprobs disagree.
        check(
            "rollout.sampling.top_p",
            sampling.top_p,
            sampling.top_p == 1.0,
            "1.0 (the trainer does not recompute top-p truncated distributions)",
        )
        check(
            "rollout.sampling.top_k",
            sampling.top_k,
            sampling.top_k == -1,
            "-1 (the trainer does not recompute top-k truncated distributions)",
        )
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.sampling = sampling
        self.ctx: RolloutContext | None = None
        self.next_group_id = 0
        self.stats: dict[str, float] = {}

    def bind(self, ctx: RolloutContext) -> None:
        self.ctx = ctx

    def submit_group(self, row: dict) -> dict[cf.Future, Pending]:
        """Submit G independent requests for one prompt (distinct seeds) and return them."""
        ctx = self.ctx
        assert ctx is not None, "controller not bound to an engine"
        gid = self.next_group_id
        self.next_group_id += 1
        prompt_ids = ctx.tokenizer(ctx.task.prompt_text(row))["input_ids"]
        out = {}
        for i in range(self.group_size):
            seed = (ctx.seed * 1_000_003 + gid * 1009 + i) % (2**31)
            fut = ctx.engine.submit(prompt_ids, self.sampling, seed=seed, request_id=f"g{gid}-s{i}")
            out[fut] = Pending(row, gid, i, seed, ctx.engine.version)
        return out

    def to_experience(self, comp: Completion, p: Pending) -> Experience:
        """Score a finished response (reward runs here, as soon as it finishes)."""
        ctx = self.ctx
        assert ctx is not None
        text = ctx.tokenizer.decode(comp.token_ids, skip_special_tokens=True)
        try:
            reward = float(ctx.task.reward(p.row, text))
        except Exception as e:
            raise RewardError(f"reward function failed on prompt id {p.row.get('id')}: {e!r}") from e
        return Experience(
            prompt_id=int(p.row.get("id", -1)),
            group_id=p.group_id,
            sample_index=p.sample_index,
            prompt_ids=list(comp.prompt_ids),
            response_ids=list(comp.token_ids),
            behavior_logprobs=list(comp.logprobs),
            reward=reward,
            policy_version=p.policy_version,
            sampling={**self.sampling.as_dict(), "seed": p.seed},
            gen_start=comp.start_time,
            gen_end=comp.end_time,
            truncated=comp.truncated,
            finish_reason=comp.finish_reason,
            version_spans=comp.version_spans or [(p.policy_version, 0, len(comp.token_ids))],
            difficulty=p.row.get("level"),
        )

    def finish_group(self, group: list[Experience]) -> list[Experience]:
        """Attach advantages once all G rewards are in."""
        assert self.ctx is not None
        group = sorted(group, key=lambda e: e.sample_index)
        for e, a in zip(group, self.ctx.advantage([e.reward for e in group])):
            e.advantage = float(a)
        return group

    def next_batch(self) -> list[Experience]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"next_group_id": self.next_group_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_group_id = int(state["next_group_id"])


def wait_any(engine: VLLMEngine, pending: set[cf.Future]) -> set[cf.Future]:
    """Block until at least one future is done, checking engine health while waiting.

    Raises ``EngineError`` if the engine dies, or if nothing finishes within
    ``engine.stall_timeout_s`` (a live but stuck engine must not hang training).
    """
    from modules.engine import EngineError

    deadline = time.monotonic() + engine.stall_timeout_s
    while True:
        done, _ = cf.wait(pending, timeout=engine.health_poll_s, return_when=cf.FIRST_COMPLETED)
        if done:
            return done
        engine.check_health()
        if time.monotonic() > deadline:
            raise EngineError(
                f"no response finished within engine.stall_timeout_s={engine.stall_timeout_s:g} s "
                f"({len(pending)} requests in flight): engine stalled"
            )


def now() -> float:
    return time.time()
