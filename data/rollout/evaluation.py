"""Held-out reward from the engine: greedy, and sampled at the training temperature.

``eval/reward_mean`` (greedy, and one ``eval/reward_level<k>`` per difficulty level) and
``eval/sampled_reward_mean`` (``samples`` per prompt at the training temperature: the quantity
RL optimises, with less noise). Rewards go through the controller's ``score``, so the reward
timeout and error policy apply as in training.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from modules.engine.types import Engine, SamplingConfig


class HeldOutEvaluator:
    def __init__(
        self,
        engine: Engine,
        task: Any,
        tokenizer: Any,
        rows: list[dict],
        score: Callable[[dict, str], float],
        temperature: float,
        max_tokens: int,
        samples: int,
    ) -> None:
        self.engine, self.task, self.tokenizer, self.rows = engine, task, tokenizer, rows
        self.score = score
        self.temperature, self.max_tokens, self.samples = temperature, max_tokens, samples

    def evaluate(self) -> dict[str, float]:
        if not self.rows:
            return {}
        greedy = self._pass(SamplingConfig(temperature=0.0, max_tokens=self.max_tokens), 1)
        out = {"eval/reward_mean": greedy["mean"], "eval/response_len_mean": greedy["len"]}
        out.update({f"eval/reward_level{lv}": r for lv, r in greedy["levels"].items()})
        if self.samples:
            sampled = self._pass(
                SamplingConfig(temperature=self.temperature, max_tokens=self.max_tokens), self.samples
            )
            out["eval/sampled_reward_mean"] = sampled["mean"]
            out.update({f"eval/sampled_reward_level{lv}": r for lv, r in sampled["levels"].items()})
        return out

    def _pass(self, sampling: SamplingConfig, n: int) -> dict[str, Any]:
        futs = {}
        for i, row in enumerate(self.rows):
            ids = self.tokenizer(self.task.prompt_text(row))["input_ids"]
            for k in range(n):
                fut = self.engine.submit(
                    ids, sampling, seed=1000 * i + k, request_id=f"eval-{time.time_ns()}-{i}-{k}"
                )
                futs[fut] = row
        rewards: dict[int, list[float]] = {}
        lengths = []
        pending = set(futs)
        while pending:
            done = self.engine.wait_any(pending)
            pending -= done
            for f in done:
                comp, row = f.result(), futs[f]
                text = self.tokenizer.decode(comp.token_ids, skip_special_tokens=True)
                rewards.setdefault(row.get("level", 0), []).append(self.score(row, text))
                lengths.append(len(comp.token_ids))
        allr = [r for rs in rewards.values() for r in rs]
        return {
            "mean": sum(allr) / len(allr),
            "len": sum(lengths) / len(lengths),
            "levels": {lv: sum(rs) / len(rs) for lv, rs in sorted(rewards.items())},
        }
