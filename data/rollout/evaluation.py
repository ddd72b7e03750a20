"""Held-out reward from the engine: greedy, and sampled at the training temperature.

``eval/reward_mean`` (greedy, and one ``eval/reward_level<k>`` per difficulty level) and
``eval/sampled_reward_mean`` (``samples`` per prompt at the training temperature: the quantity
RL optimises, with less noise). Beside each reward, the exact-match rate ``eval/exact_mean`` /
``eval/sampled_exact_mean`` (and per level): the share of responses whose reward is 1.0, the
full score (for a graded reward such as the remainder task's prefix credit, the solved rate).
Two standard errors of the sampled mean: ``eval/sampled_reward_se``, the sampling noise of one
evaluation on this fixed prompt set (sqrt(sum_i var_i / k) / n over n prompts with k samples
each: what a re-run with other sampling seeds would move), and
``eval/sampled_reward_se_prompts``, which also counts the draw of the prompts (the std of the
per-prompt means over sqrt(n): the error against the task's whole distribution). Rewards go through the controller's ``score``, so the reward timeout and error policy
apply as in training.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from data.envs.base import turn_stats
from modules.engine.types import Engine, SamplingConfig
from modules.policy.prompt_format import PlainText


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
        episodes: Any = None,
        prompt_format: Any = None,
    ) -> None:
        self.engine, self.task, self.tokenizer, self.rows = engine, task, tokenizer, rows
        self.prompt_format = prompt_format if prompt_format is not None else PlainText()
        self.episodes = episodes  # data.envs.episodes.EpisodeRunner: held-out episodes, env-scored
        self.score = score
        self.temperature, self.max_tokens, self.samples = temperature, max_tokens, samples

    def evaluate(self) -> dict[str, float]:
        if not self.rows:
            return {}
        greedy = self._pass(SamplingConfig(temperature=0.0, max_tokens=self.max_tokens), 1)
        out = {"eval/reward_mean": greedy["mean"], "eval/response_len_mean": greedy["len"]}
        out["eval/exact_mean"] = greedy["exact"]
        out.update({f"eval/{k}": v for k, v in greedy["episodes"].items()})
        out.update({f"eval/reward_level{lv}": r for lv, r in greedy["levels"].items()})
        out.update({f"eval/exact_level{lv}": r for lv, r in greedy["exact_levels"].items()})
        if self.samples:
            sampled = self._pass(
                SamplingConfig(temperature=self.temperature, max_tokens=self.max_tokens), self.samples
            )
            out["eval/sampled_reward_mean"] = sampled["mean"]
            out["eval/sampled_reward_se"] = sampled["se"]
            out["eval/sampled_reward_se_prompts"] = sampled["se_prompts"]
            out["eval/sampled_exact_mean"] = sampled["exact"]
            out["eval/sampled_response_len_mean"] = sampled["len"]
            out.update({f"eval/sampled_{k}": v for k, v in sampled["episodes"].items()})
            out.update({f"eval/sampled_reward_level{lv}": r for lv, r in sampled["levels"].items()})
            out.update({f"eval/sampled_exact_level{lv}": r for lv, r in sampled["exact_levels"].items()})
        if self.episodes is not None:  # evaluation's environment and tool counters, apart from training's
            out.update({f"eval/{k}": v for k, v in self.episodes.take_stats("eval").items()})
        return out

    def _pass(self, sampling: SamplingConfig, n: int) -> dict[str, Any]:
        futs = {}
        for i, row in enumerate(self.rows):
            ids = self.prompt_format.ids(self.tokenizer, self.task.prompt_text(row))
            for k in range(n):
                rid = f"eval-{time.time_ns()}-{i}-{k}"
                if self.episodes is not None:
                    fut = self.episodes.submit(ids, row, sampling, 1000 * i + k, rid, phase="eval")
                else:
                    fut = self.engine.submit(ids, sampling, seed=1000 * i + k, request_id=rid)
                futs[fut] = (i, row)
        rewards: dict[int, list[float]] = {}
        per_prompt: dict[int, list[float]] = {}
        lengths, episodes = [], []
        pending = set(futs)
        while pending:
            done = self.engine.wait_any(pending)
            pending -= done
            for f in done:
                comp, (i, row) = f.result(), futs[f]
                if comp.reward is not None:  # an episode, scored by its environment
                    r = float(comp.reward)
                    episodes.append(list(comp.turns or []))
                else:
                    r = self.score(row, self.tokenizer.decode(comp.token_ids, skip_special_tokens=True))
                rewards.setdefault(row.get("level", 0), []).append(r)
                per_prompt.setdefault(i, []).append(r)
                lengths.append(len(comp.token_ids))
        allr = [r for rs in rewards.values() for r in rs]
        return {
            "episodes": turn_stats(episodes),  # turns, tool calls, their validity and errors
            "mean": sum(allr) / len(allr),
            "se": sampling_error(list(per_prompt.values())),
            "se_prompts": standard_error([sum(rs) / len(rs) for rs in per_prompt.values()]),
            "exact": sum(r >= 1.0 for r in allr) / len(allr),
            "len": sum(lengths) / len(lengths),
            "levels": {lv: sum(rs) / len(rs) for lv, rs in sorted(rewards.items())},
            "exact_levels": {lv: sum(r >= 1.0 for r in rs) / len(rs) for lv, rs in sorted(rewards.items())},
        }


def standard_error(values: list[float]) -> float:
    """Sample std over sqrt(n); 0.0 for fewer than 2 values."""
    n = len(values)
    if n < 2:
        return 0.0
    m = sum(values) / n
    return (sum((v - m) ** 2 for v in values) / (n - 1) / n) ** 0.5


def sampling_error(groups: list[list[float]]) -> float:
    """Standard error of the mean of per-prompt means from the samples alone (prompts fixed):
    sqrt(sum_i s_i^2 / k_i) / n with s_i^2 the sample variance of prompt i's k_i rewards.
    NaN when a prompt has a single sample (no within-prompt variance to estimate)."""
    if not groups or any(len(g) < 2 for g in groups):
        return float("nan")
    var = 0.0
    for g in groups:
        m = sum(g) / len(g)
        var += sum((r - m) ** 2 for r in g) / (len(g) - 1) / len(g)
    return var**0.5 / len(groups)
