"""Multi-turn episodes on the rollout engine, token in and token out.

``EpisodeRunner.submit`` is what a rollout controller calls instead of ``Engine.submit`` when
the run has an environment (``env=...``): it returns a future of one ``Completion`` for the
whole episode, so every rollout mode (sync, partial, streaming) runs episodes unchanged.

An episode: the context is the prompt's token ids; each model turn is one engine request on
the context so far, ended by EOS, one of the environment's stop tokens or the token budget;
its tokens, behaviour logprobs and policy-version spans are appended as the engine returned
them (never decoded and re-encoded); the turn's text goes to ``env.step``, whose observation
is tokenised once and appended with loss mask 0 and behaviour logprob 0 (the loss, the KL,
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
import time
from dataclasses import dataclass, field, replace
from typing import Any

from data.envs.base import Environment, Step
from modules.engine.loop_thread import LoopThread
from modules.engine.types import Completion, SamplingConfig


@dataclass
class EpisodeState:
    """Where an episode is, carried across an abort (``Completion.episode``)."""

    env_state: Any = None
    turns: list[dict[str, Any]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turn_start: int = 0  # index (in the episode's tokens) where the current model turn began
    turn_versions: set[int] = field(default_factory=set)  # versions that wrote the current turn


def stop_token_ids(tokenizer: Any, stops: tuple[str, ...]) -> tuple[int, ...]:
    """The token id of each ``env.stop`` string; each must be exactly one token."""
    ids = []
    for s in stops:
        tokens = tokenizer(s, add_special_tokens=False)["input_ids"]
        if len(tokens) != 1:
            raise ValueError(
                f"env.stop: {s!r} is {len(tokens)} tokens for this tokenizer; each stop must be one token"
            )
        ids.append(int(tokens[0]))
    return tuple(ids)


class EpisodeRunner:
    def __init__(self, engine: Any, env: Environment, tokenizer: Any) -> None:
        self.engine = engine
        self.env = env
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids(tokenizer, env.stop)
        self._thread: LoopThread | None = None

    def _loop(self) -> LoopThread:
        if self._thread is None:
            thread = LoopThread("asyncrl-env")

            async def ready() -> None:
                return None

            thread.start(ready, timeout_s=30)
            self._thread = thread
        return self._thread

    def budget(self, sampling: SamplingConfig) -> int:
        """Tokens an episode may hold after its prompt (model and observation alike)."""
        return self.env.max_total_tokens or sampling.max_tokens

    def submit(
        self,
        prompt_ids: list[int],
        row: dict,
        sampling: SamplingConfig,
        seed: int,
        request_id: str,
        prefix_ids: list[int] | None = None,
        episode: EpisodeState | None = None,
    ) -> cf.Future:
        """Run (or, with ``prefix_ids`` and ``episode``, resume) an episode; the future
        resolves to its ``Completion`` (tokens after ``prompt_ids + prefix_ids``)."""
        coro = self._episode(
            list(prompt_ids), row, sampling, seed, request_id, list(prefix_ids or []), episode
        )
        return self._loop().run(coro)

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
        env = self.env
        if state is None:
            try:
                state = EpisodeState(env_state=await env.reset(row))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the environment's bug scores the episode 0
                error = {
                    "env_error": f"reset: {type(e).__name__}: {e}",
                    "span": [0, 0],
                    "observation": [0, 0],
                }
                return Completion(
                    rid, prompt_ids, [], [], "stop", 0.0, 0.0, loss_mask=[], reward=0.0, turns=[error]
                )
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
            cap = (
                room
                if env.max_turn_tokens is None
                else min(room, env.max_turn_tokens - self._turn_len(prefix, tokens, state))
            )
            sub = f"{rid}-t{len(state.turns)}" + (f"-r{k}" if k else "")
            k += 1
            if cap <= 0:  # resumed exactly at the turn's cap: the turn is complete
                comp = Completion(sub, [], [], [], "length", time.time(), time.time(), [])
            else:
                turn_sampling = replace(sampling, max_tokens=cap, stop_token_ids=self.stop_token_ids)
                fut = self.engine.submit(
                    prompt_ids + prefix + tokens, turn_sampling, seed=seed + 7 * k, request_id=sub
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
            text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
            ended_by_stop = bool(turn_ids) and turn_ids[-1] in self.stop_token_ids
            eos = comp.finish_reason == "stop" and not ended_by_stop  # the model ended the episode
            record: dict[str, Any] = {
                "span": [state.turn_start, len(prefix) + len(tokens)],
                "versions": sorted(state.turn_versions),  # across a resume, too
                "stop": bool(ended_by_stop),
            }
            t_step = time.monotonic()
            step = await self._step(state, text)  # every turn is answered, the last one scored
            end += time.monotonic() - t_step  # the episode lasts until its environment answers
            room = budget - len(prefix) - len(tokens)
            last = len(state.turns) + 1 >= env.max_turns  # no model turn would read an observation
            if eos or step.done or room <= 0 or last:
                state.turns.append({**record, **self._record(step), "observation": [0, 0]})
                cut = comp.finish_reason == "length" and room <= 0  # the budget cut the model's turn
                finish = "length" if cut or not (eos or step.done or last) else "stop"
                break
            obs = self._encode(step.observation)[:room]
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
                reward = env.final_reward(state.env_state, state.rewards, truncated)
            except Exception as e:  # noqa: BLE001 - as a failing step: the episode scores 0
                reward = 0.0
                state.turns[-1:] = [
                    {**(state.turns[-1] if state.turns else {}), "env_error": f"final_reward: {e!r}"}
                ]
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

    @staticmethod
    def _turn_len(prefix: list[int], tokens: list[int], state: EpisodeState) -> int:
        """Tokens the current model turn already holds (a turn resumed after an abort)."""
        return len(prefix) + len(tokens) - state.turn_start

    async def _step(self, state: EpisodeState, text: str) -> Step:
        try:
            step = await self.env.step(state.env_state, text)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the environment's own bug ends the episode, scored 0
            step = Step(observation="", reward=0.0, done=True, info={"env_error": f"{type(e).__name__}: {e}"})
        state.rewards.append(float(step.reward))
        return step

    @staticmethod
    def _record(step: Step) -> dict[str, Any]:
        return {"reward": float(step.reward), "done": bool(step.done), **step.info}

    def _encode(self, text: str) -> list[int]:
        # once, without BOS: the observation's ids are appended as they are
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def close(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
        self.env.close()
