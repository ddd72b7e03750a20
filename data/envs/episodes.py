"""Multi-turn episodes on the rollout engine, token in and token out.

``EpisodeRunner.submit`` is what a rollout controller calls instead of ``Engine.submit`` when
the run has an environment (``env=...``): it returns a future of one ``Completion`` for the
whole episode, so every rollout mode (sync, partial, streaming) runs episodes unchanged.

An episode: the context is the prompt's token ids; each model turn is one engine request on
the context so far, ended by EOS, one of the environment's stops (a token, or a string of
several tokens: ``stops.py``) or the token budget; its tokens, behaviour logprobs and policy-version spans are appended as the engine returned
them (never decoded and re-encoded); the turn's text goes to ``env.step``, whose observation
is rendered by the model's prompt format (a chat model: its template's tool turn), tokenised
once and appended with loss mask 0 and behaviour logprob 0 (the loss, the KL,
the IS ratios and the drift metrics all read the mask). The episode ends when the environment
says done, the model ends without a stop token (EOS), ``max_turns`` model turns are done, or
the episode's tokens reach its budget.

Weight updates: a turn generating while the weights change is continued on the new weights
(``inflight=keep``; its spans record which version made which token), or, under partial
rollout (``inflight=abort``), cut: the episode future resolves with ``finish_reason="abort"``
and the tokens so far (and its state in ``Completion.episode``); the controller resubmits it
(``RolloutController.continuation``) and the runner resumes that turn where it stopped.

Episodes run on one asyncio loop in their own thread (``asyncrl-env``), off the engine's loop
and off the controller's thread; tools run through ``env.tools`` (``tools.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextvars
import hashlib
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from data.envs.base import Environment, Step, episode_budget
from data.envs.env_calls import Deadline, EnvCalls, EnvironmentFault, bad_step, finite_number
from data.envs.http import remote_tools
from data.envs.stops import Stops
from data.envs.tools import PHASE
from modules.engine.loop_thread import LoopThread
from modules.engine.types import Completion, SamplingConfig
from modules.policy.prompt_format import PlainText

log = logging.getLogger(__name__)


@dataclass
class EpisodeState:
    """Where an episode is, carried across an abort (``Completion.episode``)."""

    env_state: Any = None
    turns: list[dict[str, Any]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turn_start: int = 0  # index (in the episode's tokens) where the current model turn began
    turn_versions: set[int] = field(default_factory=set)  # versions that wrote the current turn
    deadline: Deadline = field(default_factory=lambda: Deadline(None))  # env time left
    errors: list[str] = field(default_factory=list)  # environment errors scored 0 (on_error=zero)
    row: dict | None = None
    seed: int = 0


def turn_seed(seed: int, turn: int) -> int:
    """A sampling seed per (episode seed, request): distinct across the members of a group and
    their turns (a hash, not ``seed + turn``, which collides between neighbouring members)."""
    digest = hashlib.blake2b(f"{seed}:{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class EpisodeRunner:
    def __init__(
        self, engine: Any, env: Environment, tokenizer: Any, on_error: str = "fail", prompt_format: Any = None
    ) -> None:
        self.engine = engine
        self.env = env
        self.tokenizer = tokenizer
        # model.prompt_format: how an observation is rendered (a chat model: the template's tool turn)
        self.prompt_format = prompt_format if prompt_format is not None else PlainText()
        self.stops = Stops(tokenizer, env.stop)  # token stops and text stops
        self.calls = EnvCalls(env, on_error)
        self._thread: LoopThread | None = None
        self._lock = threading.Lock()
        self._handed: set[cf.Future] = set()  # episode futures not resolved yet
        self._open: dict[int, EpisodeState] = {}  # episodes reset and not cleaned up (aborted too)
        self._closing = False
        self._reset_takes_seed = "seed" in inspect.signature(env.reset).parameters

    def _loop(self) -> LoopThread:
        with self._lock:  # concurrent first submissions start one loop
            if self._thread is None:
                thread = LoopThread("asyncrl-env", on_death=self._loop_died)

                async def ready() -> None:
                    return None

                thread.start(ready, timeout_s=30)
                self._thread = thread
            return self._thread

    def check_health(self) -> None:
        """Raise ``EnvironmentFault`` if the episode loop died (its futures are failed too)."""
        thread = self._thread
        if thread is not None and (thread.error is not None or not thread.alive) and not self._closing:
            raise self.calls.fault("the episode loop", None, f"its thread died: {thread.error!r}")

    def _loop_died(self, error: BaseException) -> None:
        fault = self.calls.fault("the episode loop", None, f"its thread died: {error!r}")
        with self._lock:
            handed, self._handed = list(self._handed), set()
        for fut in handed:
            try:
                fut.set_exception(fault)
            except cf.InvalidStateError:  # resolved or cancelled meanwhile
                pass

    def budget(self, sampling: SamplingConfig) -> int:
        """Tokens an episode may hold after its prompt (model and observation alike)."""
        return episode_budget(self.env.max_total_tokens, sampling.max_tokens)[0]

    def submit(
        self,
        prompt_ids: list[int],
        row: dict,
        sampling: SamplingConfig,
        seed: int,
        request_id: str,
        prefix_ids: list[int] | None = None,
        episode: EpisodeState | None = None,
        phase: str = "train",
    ) -> cf.Future:
        """Run (or, with ``prefix_ids`` and ``episode``, resume) an episode; the future
        resolves to its ``Completion`` (tokens after ``prompt_ids + prefix_ids``), or fails with
        ``EnvironmentFault`` (``on_error=fail``, or the episode loop died)."""
        self.check_health()
        coro = self._episode(
            list(prompt_ids), row, sampling, seed, request_id, list(prefix_ids or []), episode
        )
        context = contextvars.copy_context()
        context.run(PHASE.set, phase)
        outer: cf.Future = cf.Future()
        inner = context.run(self._loop().run, coro)
        with self._lock:
            self._handed.add(outer)

        def settle(f: cf.Future) -> None:
            with self._lock:
                self._handed.discard(outer)
            if f.cancelled():
                outer.cancel()
                return
            try:  # the caller may cancel ``outer`` at this very moment
                if f.exception() is not None:
                    outer.set_exception(f.exception())
                else:
                    outer.set_result(f.result())
            except cf.InvalidStateError:
                pass

        inner.add_done_callback(settle)
        outer.add_done_callback(lambda f: inner.cancel() if f.cancelled() else None)
        return outer

    async def _episode(
        self,
        prompt_ids: list[int],
        row: dict,
        sampling: SamplingConfig,
        seed: int,
        rid: str,
        prefix: list[int],
        state: EpisodeState | None,
    ) -> Completion:
        """One episode (or the rest of an aborted one), with its lifecycle: ``reset`` on a new
        one, ``cleanup`` however it ends (an aborted one stays open until it is resumed or the
        runner closes), and the fault contract (``env_calls.py``)."""
        if state is None:
            state = EpisodeState(row=row, seed=seed, deadline=Deadline(self.env.episode_timeout_s))
            try:
                args = (row, seed) if self._reset_takes_seed else (row,)
                state.env_state = await self.calls.call(
                    "reset", row, state.deadline, *args, abandoned=self._clean_abandoned
                )
            except EnvironmentFault as fault:
                error = {
                    "env_error": str(fault),
                    "env_errors": [str(fault)],
                    "span": [0, 0],
                    "observation": [0, 0],
                }
                self._fault(fault)  # raises under on_error=fail
                return Completion(
                    rid, prompt_ids, [], [], "stop", 0.0, 0.0, loss_mask=[], reward=0.0, turns=[error]
                )
            self._open[id(state)] = state
        reason = "cancelled"
        try:
            comp = await self._turns(prompt_ids, row, sampling, rid, prefix, state)
            reason = "open" if comp.finish_reason == "abort" else "truncated" if comp.truncated else "done"
            return comp
        except EnvironmentFault:
            reason = "error"
            raise
        finally:
            if reason != "open":
                await self._cleanup(state, "teardown" if self._closing else reason)

    def _fault(self, fault: EnvironmentFault, state: EpisodeState | None = None) -> None:
        """The fault contract: raise under ``on_error=fail``; else count it and note it in the
        episode (which then scores 0)."""
        if self.calls.on_error == "fail":
            raise fault
        self.calls.count(PHASE.get(), fault.method)
        if state is not None:
            state.errors.append(str(fault))

    def _clean_abandoned(self, env_state: Any) -> None:
        """A ``reset`` that returned after its episode was cancelled: clean what it made."""
        self.calls.spawn("cleanup", env_state, "cancelled")

    async def _cleanup(self, state: EpisodeState, reason: str) -> None:
        if self._open.pop(id(state), None) is None:
            return
        try:
            await asyncio.shield(
                self.calls.call("cleanup", state.row, Deadline(None), state.env_state, reason)
            )
        except EnvironmentFault as fault:
            self._cleanup_failed(PHASE.get(), fault)

    def _cleanup_failed(self, phase: str, fault: EnvironmentFault) -> None:
        """Counted and logged, never fatal: the episode is over."""
        self.calls.count(phase, "cleanup")
        log.warning("%s", fault)

    async def _turns(
        self,
        prompt_ids: list[int],
        row: dict,
        sampling: SamplingConfig,
        rid: str,
        prefix: list[int],
        state: EpisodeState,
    ) -> Completion:
        env = self.env
        budget = self.budget(sampling)
        tokens: list[int] = []  # this submission's tokens (after prompt + prefix)
        logprobs: list[float] = []
        mask: list[int] = []
        spans: list[tuple[int, int, int]] = []
        start = end = None
        finish: str | None = None
        k = 0
        while True:
            used = len(prefix) + len(tokens)
            room = budget - used
            if room <= 0:
                finish = "length"
                break
            turn_len = len(prefix) + len(tokens) - state.turn_start  # a turn resumed after an abort
            cap = room if env.max_turn_tokens is None else min(room, env.max_turn_tokens - turn_len)
            sub = f"{rid}-t{len(state.turns)}" + (f"-r{k}" if k else "")
            k += 1
            if cap <= 0:  # resumed exactly at the turn's cap: the turn is complete
                comp = Completion(sub, [], [], [], "length", time.time(), time.time(), [])
            else:
                turn_sampling = self.stops.sampling(sampling, cap)
                seed = turn_seed(state.seed, len(state.turns) * 1000 + k)
                fut = self.engine.submit(
                    prompt_ids + prefix + tokens, turn_sampling, seed=seed, request_id=sub
                )
                comp = await asyncio.wrap_future(fut)
            state.turn_versions |= {v for v, s, e in comp.version_spans if e > s}
            start = comp.start_time if start is None else start
            end = comp.end_time
            off = len(tokens)
            tokens += comp.token_ids
            logprobs += comp.logprobs
            mask += [1] * len(comp.token_ids)
            spans += [(v, s + off, e + off) for v, s, e in comp.version_spans]
            if comp.finish_reason == "abort":
                finish = "abort"  # the controller resubmits; the turn resumes at state.turn_start
                break
            turn_ids = (prefix + tokens)[state.turn_start :]
            keep, ended_by_stop = self.stops.end(self.tokenizer, turn_ids)
            extra = min(len(turn_ids) - keep, len(comp.token_ids))  # sampled past a text stop
            if extra:
                del tokens[-extra:], logprobs[-extra:], mask[-extra:], turn_ids[-extra:]
                spans = [(v, s, min(e, len(tokens))) for v, s, e in spans if s < len(tokens)]
            text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
            eos = comp.finish_reason == "stop" and not ended_by_stop  # the model ended the episode
            record: dict[str, Any] = {
                "span": [state.turn_start, len(prefix) + len(tokens)],
                "versions": sorted(state.turn_versions),  # across a resume, too
                "stop": bool(ended_by_stop),
            }
            t_step = time.monotonic()
            step = await self._step(state, text, row)  # every turn is answered, the last one scored
            end += time.monotonic() - t_step  # the episode lasts until its environment answers
            room = budget - len(prefix) - len(tokens)
            last = len(state.turns) + 1 >= env.max_turns  # no model turn would read an observation
            if eos or step.done or room <= 0 or last:
                state.turns.append({**record, **self._record(step), "observation": [0, 0]})
                cut = comp.finish_reason == "length" and not ended_by_stop and room <= 0  # the budget cut it
                finish = "length" if cut or not (eos or step.done or last) else "stop"
                break
            obs = self._encode(self.prompt_format.observation(self.tokenizer, step.observation))[:room]
            at = len(prefix) + len(tokens)
            tokens += obs
            logprobs += [0.0] * len(obs)
            mask += [0] * len(obs)
            state.turns.append({**record, **self._record(step), "observation": [at, at + len(obs)]})
            state.turn_start = len(prefix) + len(tokens)
            state.turn_versions = set()
        truncated = finish == "length"
        reward = None
        if finish != "abort":
            try:
                value = await self.calls.call(
                    "final_reward", row, state.deadline, state.env_state, state.rewards, truncated
                )
                reward = finite_number(value)
                if reward is None:
                    raise self.calls.fault("final_reward", row, f"returned {value!r}, not a finite number")
            except EnvironmentFault as fault:
                self._fault(fault, state)
            if state.errors:  # under on_error=zero: an episode with an environment error scores 0
                reward = 0.0
                last = state.turns[-1] if state.turns else {"span": [0, 0], "observation": [0, 0]}
                state.turns[-1:] = [{**last, "env_error": state.errors[-1], "env_errors": list(state.errors)}]
        comp = Completion(
            rid,
            prompt_ids,
            tokens,
            logprobs,
            finish,
            start if start is not None else 0.0,
            end if end is not None else 0.0,
            spans,
            loss_mask=mask,
            reward=reward,
            turns=list(state.turns),
            episode=state,
        )
        return comp

    async def _step(self, state: EpisodeState, text: str, row: dict) -> Step:
        try:
            step = await self.calls.call("step", row, state.deadline, state.env_state, text)
            problem = bad_step(step)
            if problem:
                raise self.calls.fault("step", row, problem)
        except EnvironmentFault as fault:  # scored 0 and counted, or (on_error=fail) raised
            self._fault(fault, state)
            step = Step(observation="", reward=0.0, done=True, info={"env_error": str(fault)})
        for tool in remote_tools(self.env):  # a server past its failure threshold stops the run
            tool.check_health()
        state.rewards.append(float(step.reward))
        return step

    @staticmethod
    def _record(step: Step) -> dict[str, Any]:
        return {"reward": float(step.reward), "done": bool(step.done), **step.info}

    def _encode(self, text: str) -> list[int]:
        # once, without BOS: the observation's ids are appended as they are
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def take_stats(self, phase: str = "train") -> dict[str, float]:
        """Environment errors and the tools' counters of ``phase`` since the last call."""
        return {**self.calls.take_stats(phase), **self.env.tools.take_stats(phase)}

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the episode loop (episodes in flight are cancelled and cleaned up, reason
        ``teardown``), clean up the episodes still open (aborted, never resumed), then close
        the environment."""
        self._closing = True
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
        with self._lock:  # the loop is gone: no episode future may stay pending
            handed, self._handed = list(self._handed), set()
        for fut in handed:
            fut.cancel()
        for state in list(self._open.values()):
            self._open.pop(id(state), None)
            try:
                self.calls.run_sync("cleanup", state.row, timeout_s, state.env_state, "teardown")
            except EnvironmentFault as fault:
                self._cleanup_failed("train", fault)
        self.calls.close()
        self.env.close()
