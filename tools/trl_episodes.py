"""Multi-turn episodes for TRL's GRPOTrainer: the project's environment as a ``rollout_func``.

    .venv-trl/bin/python -m tools.trl_peer --run-dir outputs/bench/trl_agent/seed0 --seed 0 -- \\
        recipe=agent_calculator rollout=sync "~rollout.max_staleness" algo/correction=none \\
        algo.loss.anchor=bypass

    .venv-trl/bin/python -m tools.trl_peer --run-dir outputs/bench/trl_tools/seed0 --seed 0 -- \\
        recipe=smollm2_tools                                  # the real chat model's tool calls

``tools/trl_peer.py`` uses this when the composed config has an environment (``env=...``).
TRL's own tool loop (``tools=`` / ``environment_factory=``) renders tool results with the chat
template and parses calls with a response schema it knows for some templates; the character
model has no template, and SmolLM2's renders no tool definitions and has no schema TRL knows
(``add_response_schema`` refuses it: "Unrecognized chat template"), so the peer takes TRL's
documented hook for custom multi-turn generation instead: a ``rollout_func`` that returns the
token ids of each episode and an ``env_mask`` (1 on model tokens, 0 on observation tokens: TRL
masks the latter out of the loss and the KL, as the project does). The loop is TRL's own shape:
one batched ``generate`` for every episode still running, then every environment step of that
turn concurrently (the tool's latency model included), then the next turn for the episodes
that go on.

The episode rules are those of ``data/envs/episodes.py``: prompts become ids through
``model.prompt_format`` (a chat model's template); a turn ends at an ``env.stop`` (a token, or a
text stop such as ``</tool_call>``: Hugging Face's ``stop_strings``, the turn cut after the
token that completes it, as ``data/envs/stops.py`` cuts the engine's), EOS,
``env.max_turn_tokens`` or the budget; the turn's text goes to ``env.step``, whose observation is
rendered by the prompt format (a chat model: the template's tool turn, the ``<|im_end|>``
that closes the calling turn included), tokenised once and appended (mask 0); the episode ends
when the environment says done, the model writes EOS, ``env.max_turns`` turns are done or its
tokens (model and observation) reach the budget (``env.max_total_tokens`` or
``rollout.sampling.max_tokens``); its reward is ``env.final_reward``, ``truncated`` as the runner's ``finish_reason == "length"``.
Behaviour logprobs are the sampling distribution's (after temperature / top-k / top-p), as the
engine's ``processed_logprobs`` are (``Sampler``, one token's at a time); with
``use_vllm=False`` TRL reads them nowhere in the loss (its ratio's anchor is its own recomputed
logprobs), so they are returned for completeness.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from data.envs.stops import Stops
from modules.policy.prompt_format import PlainText


class Sampler(LogitsProcessor):
    """Temperature, top-k and top-p as ``generate`` applies them (Hugging Face's own warpers, in
    its order), and the log-probability of each sampled token under that distribution, kept as
    it is drawn: ``output_scores`` would keep every step's whole distribution instead (64 x 64 x
    49,152 floats, 0.8 GB a turn for the tool recipe, and as much again to stack them). It must
    be the last processor: ``generate`` is given no warper of its own."""

    def __init__(self, temperature: float, top_k: int, top_p: float) -> None:
        self.warpers: list[LogitsProcessor] = []
        if temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k > 0:
            self.warpers.append(TopKLogitsWarper(top_k=top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=top_p))
        self.last: torch.Tensor | None = None  # the previous step's log-distribution [B, vocab]
        self.chosen: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.last is not None:  # the token drawn at the previous step is input_ids' last
            self.chosen.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        self.last = scores.log_softmax(-1)
        return scores

    def logprobs(self, sequences: torch.Tensor) -> torch.Tensor:
        """``[B, new tokens]``: each sampled token's log-probability (``sequences``: generate's)."""
        if self.last is None:
            return torch.zeros(sequences.shape[0], 0)
        return torch.stack([*self.chosen, self.last.gather(-1, sequences[:, -1:]).squeeze(-1)], dim=1)


class EpisodeRollout:
    """``rollout_func(prompts, trainer)`` for TRL: one episode per prompt (TRL repeats each
    prompt ``num_generations`` times), its reward in the ``episode_reward`` field."""

    def __init__(
        self,
        env: Any,
        task: Any,
        rows: dict[str, dict],
        tokenizer: Any,
        sampling: Any,
        prompt_format: Any = None,
    ) -> None:
        self.env = env
        self.task = task
        self.rows = rows  # prompt text -> dataset row
        self.tokenizer = tokenizer
        self.temperature = float(sampling.temperature)
        self.top_p = float(sampling.top_p)
        self.top_k = int(sampling.top_k)
        self.budget = int(env.max_total_tokens or sampling.max_tokens)
        self.turn_cap = env.max_turn_tokens  # None: only the episode's budget
        self.stops = Stops(tokenizer, env.stop)  # as EpisodeRunner: token stops and text stops
        self.prompt_format = prompt_format if prompt_format is not None else PlainText()
        self.loop = asyncio.new_event_loop()
        self.turn_stats: list[list[dict]] = []
        # mean episode length of the last call, model and observation tokens (as the project counts)
        self.response_len_mean = float("nan")

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, list]:
        from trl.models import unwrap_model_for_generation

        # as TRL generates: gradient checkpointing off (with it, generate's KV cache is dropped)
        with unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model:
            return self.episodes(prompts, model)

    def episodes(self, prompts: list[str], model: Any) -> dict[str, list]:
        rows = [self.rows[p] for p in prompts]
        prompt_ids = [self.prompt_format.ids(self.tokenizer, self.task.prompt_text(r)) for r in rows]
        states = self.run([self.env.reset(r) for r in rows])
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        mask: list[list[int]] = [[] for _ in rows]
        rewards: list[list[float]] = [[] for _ in rows]
        turns: list[list[dict]] = [[] for _ in rows]
        truncated = [False] * len(rows)  # EpisodeRunner's finish == "length"
        running = list(range(len(rows)))
        for turn in range(self.env.max_turns):
            for i in running:
                truncated[i] = len(tokens[i]) >= self.budget  # an observation filled the budget
            running = [i for i in running if not truncated[i]]
            if not running:
                break
            caps = [self.budget - len(tokens[i]) for i in running]
            if self.turn_cap is not None:
                caps = [min(c, self.turn_cap) for c in caps]
            new, lps, stopped = self.generate(model, [prompt_ids[i] + tokens[i] for i in running], caps)
            texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in new]
            steps = self.run([self.step(states[i], text) for i, text in zip(running, texts)])
            going = []
            for i, ids, lp, ended_by_stop, step in zip(running, new, lps, stopped, steps):
                tokens[i] += ids
                logprobs[i] += lp
                mask[i] += [1] * len(ids)
                rewards[i].append(float(step.reward))
                turns[i].append({"reward": float(step.reward), "done": bool(step.done), **step.info})
                eos = not ended_by_stop and ids[-1] == self.tokenizer.eos_token_id
                room = self.budget - len(tokens[i])
                last = turn + 1 >= self.env.max_turns
                if eos or step.done or room <= 0 or last:
                    cut = not (eos or ended_by_stop) and room <= 0  # the budget cut the model's turn
                    truncated[i] = cut or not (eos or step.done or last)
                    continue
                rendered = self.prompt_format.observation(self.tokenizer, step.observation)
                obs = list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])[:room]
                tokens[i] += obs
                logprobs[i] += [0.0] * len(obs)
                mask[i] += [0] * len(obs)
                going.append(i)
            running = going
        self.turn_stats.extend(turns)
        self.response_len_mean = sum(map(len, tokens)) / max(1, len(tokens))
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": tokens,
            "logprobs": logprobs,
            "env_mask": mask,
            "episode_reward": [
                float(self.env.final_reward(s, r, t)) for s, r, t in zip(states, rewards, truncated)
            ],
        }

    def close(self) -> None:
        """Stop the environment (its tool runner, a tool server it started) and the event loop."""
        self.env.close()
        self.loop.close()

    def run(self, coros: list) -> list:
        """The coroutines, concurrently, on this rollout's event loop."""

        async def together() -> list:
            return await asyncio.gather(*coros)

        return self.loop.run_until_complete(together())

    async def step(self, state: Any, text: str) -> Any:
        from data.envs.base import Step

        try:
            return await self.env.step(state, text)
        except Exception as e:  # noqa: BLE001 - as the project's runner: the episode ends, scored 0
            return Step(observation="", reward=0.0, done=True, info={"env_error": f"{type(e).__name__}: {e}"})

    @torch.no_grad()
    def generate(
        self, model: Any, contexts: list[list[int]], caps: list[int]
    ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        """One model turn for each context (left-padded batch): the new ids, cut after the first
        EOS or stop (a stop token, or the token that completes a text stop) and at the turn's cap
        (``caps``, >= 1 each), their sampling logprobs, and whether a stop ended the turn. A row
        sampled past its cap is cut there: its first ``cap`` tokens are drawn as with
        ``max_tokens=cap``."""
        pad = self.tokenizer.pad_token_id
        width = max(map(len, contexts))
        ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts])
        attention = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
        text_stops = {"stop_strings": list(self.stops.strings), "tokenizer": self.tokenizer}
        sampler = Sampler(self.temperature, self.top_k, self.top_p)
        out = model.generate(
            input_ids=ids,
            attention_mask=attention,
            do_sample=True,
            # the warpers are the sampler's (so it sees what each token was drawn from): none here;
            # top_k 0, not None: None is Hugging Face's default of 50
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            logits_processor=LogitsProcessorList([sampler]),
            max_new_tokens=max(caps),
            eos_token_id=[self.tokenizer.eos_token_id, *self.stops.token_ids],
            pad_token_id=pad,
            return_dict_in_generate=True,
            **(text_stops if self.stops.strings else {}),
        )
        new = out.sequences[:, width:]
        chosen = sampler.logprobs(out.sequences)
        ends = {self.tokenizer.eos_token_id, *self.stops.token_ids}
        result, lps, stopped = [], [], []
        for row, lp, cap in zip(new.tolist(), chosen.tolist(), caps):
            # the row is padded after its end (pad may be EOS: SmolLM2's), so the first end counts
            n = next((k + 1 for k, t in enumerate(row) if t in ends), len(row))
            n, by_stop = self.stops.end(self.tokenizer, row[: min(n, cap)])  # a token or text stop
            result.append(row[:n])
            lps.append(lp[:n])
            stopped.append(by_stop)
        return result, lps, stopped
