"""What every rollout controller shares: request submission, reward, groups, carry-over.

A controller (``sync.py``, ``partial.py``, ``streaming.py``) asks the engine for responses and
returns complete, advantage-scored groups of ``Experience``. Rewards are computed as each
response finishes, while the rest of the batch is still generating. The datamodule binds a
controller to the engine (``bind``) and asks it for rollout batches (``next_batch``).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from data.envs.http import RemoteDownError
from data.rollout.bias import BiasTracker
from data.rollout.experience import Experience
from data.rollout.handoff import HandOff
from data.rollout.requests import Pending, RolloutContext, merge_spans
from data.rollout.rewards import RewardRunner, RewardWorkerError
from data.rollout.shaping import InformativeGroups, Overlong
from data.rollout.staleness import StalenessBound
from modules.config.errors import check, check_choice
from modules.engine.types import Completion, SamplingConfig


class RewardError(RuntimeError):
    """The task's reward function raised; the message names the prompt."""


class RolloutController(HandOff):
    """Base class: request bookkeeping shared by the rollout modes.

    Subclasses define ``next_batch``. What the datamodule reads is defined here with the
    values of a controller that holds nothing between batches (sync); streaming overrides.
    """

    # What requests still generating do when weights change (``Engine.update_weights``).
    inflight = "keep"
    # True for the global barrier (sync): the only mode where a delayed sync makes lag exact.
    barrier = False
    # Every staleness decision of a mode that can train stale groups (partial, streaming);
    # None behind the sync barrier, where nothing is ever stale.
    bound: StalenessBound | None = None
    # The trainer's version when it differs from the engine's (a delayed sync, sync mode only).
    trainer_version: int | None = None

    def __init__(
        self,
        prompts_per_step: int,
        group_size: int,
        sampling: SamplingConfig,
        group_filter: InformativeGroups | None = None,
        overlong: Overlong | None = None,
    ) -> None:
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
        # DAPO's shaping (data/rollout/shaping.py): dynamic sampling, overlong mask / penalty
        check(
            "rollout.group_size",
            group_size,
            group_filter is None or group_size >= 2,
            "an int >= 2 with rollout.group_filter (one response is never informative)",
        )
        self.group_filter = group_filter
        self.overlong = overlong  # its buffer is checked against the budget in bind (an episode's, too)
        self.ctx: RolloutContext | None = None
        self.bias = BiasTracker()
        self.next_group_id = 0
        self.stats: dict[str, float] = {}
        # Reward failures: "fail" stops the run; "zero" scores 0 and counts rollout/reward_errors.
        self.reward_errors = "fail"
        self.reward_timeout_s: float | None = None
        self.reward_error_count = 0
        self._rewards: RewardRunner | None = None  # worker processes, only with a timeout
        self._batches_per_version = 1  # rollout batches per weight sync (data.sync_every)
        # Held while a checkpoint snapshots the controller and the prompt cursor together.
        self.lock: AbstractContextManager = threading.RLock()

    @property
    def max_staleness(self) -> int | None:
        """Policy versions a trained group may lag (None: unbounded, or the sync barrier)."""
        return None if self.bound is None else self.bound.max_staleness

    @property
    def batches_per_version(self) -> int:
        """Rollout batches per weight sync (``data.sync_every``)."""
        return self._batches_per_version

    @batches_per_version.setter
    def batches_per_version(self, n: int) -> None:
        self._batches_per_version = n
        if self.bound is not None:
            self.bound.batches_per_version = n

    def check_advantage(self, advantage: Any) -> None:
        """Raise ``ConfigError`` if this mode cannot use ``advantage`` (start-up check)."""
        check(
            "algo.advantage",
            type(advantage).__name__,
            not advantage.per_response,
            f"group (or another group-wise estimator) with {type(self).__name__}: only streaming "
            "releases responses one by one",
        )

    def configure_rewards(self, on_error: str = "fail", timeout_s: float | None = None) -> None:
        check_choice("data.reward_errors", on_error, ("fail", "zero"))
        check("data.reward_timeout_s", timeout_s, timeout_s is None or timeout_s > 0, "null or a float > 0")
        self.reward_errors, self.reward_timeout_s = on_error, timeout_s
        self._start_rewards()

    def _start_rewards(self) -> None:
        """(Re)build the reward runner for the bound task and the configured timeout."""
        if self._rewards is not None and self.reward_timeout_s is not None:
            self._rewards.timeout_s = self.reward_timeout_s  # same task: keep the live workers
            return
        self.close_rewards()
        if self.reward_timeout_s is not None and self.ctx is not None:
            self._rewards = RewardRunner(self.ctx.task, self.reward_timeout_s)

    def close_rewards(self) -> None:
        """Stop the reward worker processes (called by ``close``)."""
        if self._rewards is not None:
            self._rewards.close()
            self._rewards = None

    def close(self) -> None:
        self.close_rewards()

    def score(self, row: dict, text: str) -> float:
        """The task's reward, with the configured timeout and error policy.

        With a timeout the reward runs in a worker process (``data/rollout/rewards.py``); a
        call that overruns has its worker killed and replaced, and is handled like an error.
        """
        ctx = self.ctx
        assert ctx is not None
        try:
            if self.reward_timeout_s is None:
                return float(ctx.task.reward(row, text))
            if self._rewards is None:  # never inline with a timeout: it could hang this thread
                raise RewardWorkerError("reward runner is closed")
            return self._rewards(row, text)
        except (RewardWorkerError, RemoteDownError):  # the runner is broken, the server down:
            raise  # no single reward to zero; the run stops naming it
        except Exception as e:
            if self.reward_errors == "zero":
                self.reward_error_count += 1
                return 0.0
            raise RewardError(f"reward function failed on prompt id {row.get('id')}: {e!r}") from e

    def bind(self, ctx: RolloutContext) -> None:
        self.check_advantage(ctx.advantage)
        self.close_rewards()  # a new task needs new workers
        self.ctx = ctx
        if self.overlong is not None:  # at start-up: overlong_fits_budget (data/rollout/shaping.py)
            self.overlong.check_fits(self.token_budget)
        self._start_rewards()

    def plan_group(self, row: dict) -> list[Pending]:
        """G independent requests for one prompt (distinct seeds), with the next group id."""
        ctx = self.ctx
        assert ctx is not None, "controller not bound to an engine"
        gid = self.next_group_id
        self.next_group_id += 1
        prompt_ids = ctx.prompt_ids(row)
        return [
            Pending(
                row,
                gid,
                i,
                (ctx.seed * 1_000_003 + gid * 1009 + i) % (2**31),
                ctx.engine.version,
                prompt_ids=list(prompt_ids),
            )
            for i in range(self.group_size)
        ]

    def submit_planned(self, group: list[Pending]) -> dict[cf.Future, Pending]:
        out = {}
        for p in group:
            out[self.submit(p)] = p
            self.bias.on_issue(p.row.get("level"))
        return out

    def submit_group(self, row: dict) -> dict[cf.Future, Pending]:
        """Submit G independent requests for one prompt (distinct seeds) and return them."""
        return self.submit_planned(self.plan_group(row))

    def submit(self, p: Pending) -> cf.Future:
        """Send one (possibly continued) request to the engine: one completion, or with a
        multi-turn environment one episode (``data/envs/episodes.py``; same future, same
        ``Completion``, so every mode runs episodes unchanged)."""
        ctx = self.ctx
        assert ctx is not None
        seed = (p.seed + 7919 * p.splits) % (2**31)
        rid = f"g{p.group_id}-s{p.sample_index}" + (f"-c{p.splits}" if p.splits else "")
        if ctx.episodes is not None:
            return ctx.episodes.submit(p.prompt_ids, p.row, self.sampling, seed, rid, p.prefix_ids, p.episode)
        remaining = self.sampling.max_tokens - len(p.prefix_ids)
        sampling = replace(self.sampling, max_tokens=max(1, remaining))
        return ctx.engine.submit(p.prompt_ids + p.prefix_ids, sampling, seed=seed, request_id=rid)

    @property
    def token_budget(self) -> int:
        """Tokens a response may hold: ``rollout.sampling.max_tokens``, or an episode's budget
        (``env.max_total_tokens``, model and observation tokens alike)."""
        episodes = self.ctx.episodes if self.ctx is not None else None
        return self.sampling.max_tokens if episodes is None else episodes.budget(self.sampling)

    def continuation(self, comp: Completion, p: Pending) -> Pending:
        """The pending request that resumes an aborted one from its partial response."""
        off = len(p.prefix_ids)
        spans = [(v, s + off, e + off) for v, s, e in comp.version_spans] or [
            (p.policy_version, off, off + len(comp.token_ids))
        ]
        return replace(
            p,
            prefix_ids=p.prefix_ids + list(comp.token_ids),
            prefix_logprobs=p.prefix_logprobs + list(comp.logprobs),
            prefix_spans=merge_spans(p.prefix_spans + spans),
            prefix_mask=p.prefix_mask + self._mask(comp),
            episode=comp.episode if comp.episode is not None else p.episode,
            splits=p.splits + 1,
            gen_start=p.gen_start if p.gen_start is not None else comp.start_time,
        )

    @staticmethod
    def _mask(comp: Completion) -> list[int]:
        return list(comp.loss_mask) if comp.loss_mask is not None else [1] * len(comp.token_ids)

    def is_unfinished(self, comp: Completion, p: Pending) -> bool:
        """Aborted with token budget left: resubmit rather than train on it."""
        return comp.finish_reason == "abort" and len(p.prefix_ids) + len(comp.token_ids) < self.token_budget

    def to_experience(self, comp: Completion, p: Pending) -> Experience:
        """Score a finished response (reward runs here, as soon as it finishes)."""
        ctx = self.ctx
        assert ctx is not None
        token_ids = p.prefix_ids + list(comp.token_ids)
        logprobs = p.prefix_logprobs + list(comp.logprobs)
        off = len(p.prefix_ids)
        spans = p.prefix_spans + [(v, s + off, e + off) for v, s, e in comp.version_spans]
        if not spans:
            spans = [(p.policy_version, 0, len(token_ids))]
        budget = self.token_budget
        if comp.reward is not None:  # an episode: the environment scored it
            reward = task_reward = float(comp.reward)
        else:
            reward = task_reward = self.score(
                p.row, ctx.tokenizer.decode(token_ids, skip_special_tokens=True)
            )
        truncated = comp.truncated or len(token_ids) >= budget
        # an episode's observation tokens are context, not trained on (mask 0)
        mask = p.prefix_mask + self._mask(comp) if comp.loss_mask is not None or p.prefix_mask else None
        if self.overlong is not None:
            # the model's own tokens against the room the budget left them (an episode's
            # observations are neither its length nor its room)
            length = len(token_ids) if mask is None else sum(mask)
            reward += self.overlong.length_penalty(length, budget - (len(token_ids) - length))
            cut = self.overlong.mask(truncated, len(token_ids))
            if cut is not None:  # no cut: the episode's mask stays as it is
                mask = cut if mask is None else [a * b for a, b in zip(mask, cut)]
        exp = Experience(
            prompt_id=int(p.row.get("id", -1)),
            group_id=p.group_id,
            sample_index=p.sample_index,
            prompt_ids=list(p.prompt_ids or comp.prompt_ids),
            response_ids=token_ids,
            behavior_logprobs=logprobs,
            reward=reward,
            policy_version=p.policy_version,
            sampling={**self.sampling.as_dict(), "seed": p.seed},
            gen_start=p.gen_start if p.gen_start is not None else comp.start_time,
            gen_end=comp.end_time,
            truncated=truncated,
            finish_reason=comp.finish_reason,
            version_spans=merge_spans(spans),
            loss_mask=mask,
            difficulty=p.row.get("level"),
            splits=p.splits,
        )
        if self.overlong is not None:
            exp.extras["task_reward"] = task_reward
        if comp.turns is not None:  # each turn's span, versions, reward and tool outcome
            exp.extras["turns"] = comp.turns
        self.bias.on_generated(exp)
        return exp

    def informative(self, group: list[Experience]) -> bool:
        """Whether ``rollout.group_filter`` keeps a complete group (always, without one). Judged on
        the task's own reward, before the overlong shaping: DAPO filters on accuracy, and length
        differences among equally right answers teach nothing about being right."""
        if self.group_filter is None:
            return True
        return self.group_filter.keep([e.extras.get("task_reward", e.reward) for e in group])

    def finish_group(self, group: list[Experience]) -> list[Experience]:
        """Attach advantages once all G rewards are in."""
        assert self.ctx is not None
        group = sorted(group, key=lambda e: e.sample_index)
        for e, a in zip(group, self.ctx.advantage([e.reward for e in group])):
            e.advantage = float(a)
        return group

    def next_batch(self) -> list[Experience]:
        """One rollout batch of complete, advantage-scored groups (each mode defines it)."""
        raise NotImplementedError(
            f"{type(self).__name__} is a base class: use SyncRollout, PartialRollout or StreamingRollout"
        )

    def snapshot(self) -> dict[str, Any]:
        """Counts for tests and metrics (buffer, groups in flight, ...); none here."""
        return {}

    def batches_taken_this_version(self) -> int:
        """Rollout batches already taken at the engine's current version: nonzero only when a
        checkpoint saved mid-version (``data.sync_every`` > 1) was restored, so the datamodule's
        next sync comes where it would have (admission control counts on it)."""
        return 0

    def state_dict(self, in_training: bool = False) -> dict[str, Any]:
        """``in_training``: the batch handed out last has no optimizer step in the checkpoint
        (``handoff.py``): give it back."""
        return {"next_group_id": self.next_group_id, "bias": self._bias_state(in_training)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_group_id = int(state["next_group_id"])
        if "bias" in state:
            self.bias.load_state_dict(state["bias"])
