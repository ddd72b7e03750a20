"""Held-out evaluation figures from a scripted engine (no vLLM): means per level, exact match,
the two standard errors, and the before/after lines ``make train`` prints."""

from __future__ import annotations

import concurrent.futures as cf
import math

import pytest

from data.rollout.evaluation import HeldOutEvaluator, sampling_error, standard_error
from modules.callbacks.held_out import before_after
from modules.engine.types import Completion


class ScriptedEngine:
    """Completes every request at once; the response text is ``script(prompt, seed, greedy)``."""

    def __init__(self, script) -> None:
        self.script = script

    def submit(self, prompt_ids, sampling, seed=None, request_id=None, prompt_logprobs=False):
        text = self.script(bytes(prompt_ids).decode(), seed, sampling.temperature == 0.0)
        fut: cf.Future = cf.Future()
        fut.set_result(
            Completion(request_id or "", list(prompt_ids), list(text.encode()), [], "stop", 0.0, 0.0)
        )
        return fut

    def wait_any(self, pending):
        return set(pending)


class ByteTokenizer:
    def __call__(self, text):
        return {"input_ids": list(text.encode())}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode()


class Task:
    def prompt_text(self, row):
        return row["prompt"]


ROWS = [{"prompt": "a", "level": 0}, {"prompt": "b", "level": 0}, {"prompt": "c", "level": 1}]

SCORES = {"a": [1.0, 1.0, 0.5, 0.0], "b": [1.0] * 4, "c": [0.25] * 4}


def script(prompt, seed, greedy):
    if greedy:
        return "1.0" if prompt in "ab" else "0.0"
    return str(SCORES[prompt][seed % 1000])


def evaluator(samples=4):
    return HeldOutEvaluator(
        ScriptedEngine(script), Task(), ByteTokenizer(), ROWS, lambda row, text: float(text), 1.0, 16, samples
    )


def test_means_exact_match_and_levels_by_hand():
    out = evaluator().evaluate()
    assert out["eval/reward_mean"] == pytest.approx(2 / 3)
    assert out["eval/exact_mean"] == pytest.approx(2 / 3)
    assert out["eval/reward_level0"] == 1.0 and out["eval/reward_level1"] == 0.0
    all_samples = SCORES["a"] + SCORES["b"] + SCORES["c"]
    assert out["eval/sampled_reward_mean"] == pytest.approx(sum(all_samples) / 12)
    # exact match = reward 1.0: a twice, b four times, c never
    assert out["eval/sampled_exact_mean"] == pytest.approx(6 / 12)
    assert out["eval/sampled_exact_level0"] == pytest.approx(6 / 8)
    assert out["eval/sampled_exact_level1"] == 0.0
    assert out["eval/sampled_reward_level0"] == pytest.approx((2.5 + 4.0) / 8)


def test_standard_errors_by_hand():
    out = evaluator().evaluate()
    # sampling noise only: prompt a's sample variance over k = 4, b and c have none
    a = SCORES["a"]
    m = sum(a) / 4
    var_a = sum((x - m) ** 2 for x in a) / 3
    assert out["eval/sampled_reward_se"] == pytest.approx(math.sqrt(var_a / 4) / 3)
    # with the draw of prompts: the std of the three per-prompt means over sqrt(3)
    means = [m, 1.0, 0.25]
    mm = sum(means) / 3
    assert out["eval/sampled_reward_se_prompts"] == pytest.approx(
        math.sqrt(sum((x - mm) ** 2 for x in means) / 2 / 3)
    )


def test_error_helpers_edge_cases():
    assert standard_error([0.3]) == 0.0
    assert math.isnan(sampling_error([[1.0], [0.0]]))  # one sample per prompt: no estimate
    assert math.isnan(sampling_error([]))
    # more samples per prompt -> smaller sampling error, same spread
    assert sampling_error([[0.0, 1.0] * 8]) < sampling_error([[0.0, 1.0]])


def test_greedy_only_when_no_samples():
    out = evaluator(samples=0).evaluate()
    assert "eval/sampled_reward_mean" not in out and out["eval/reward_mean"] == pytest.approx(2 / 3)


def test_before_after_lines_name_levels_and_versions():
    first = {"eval/sampled_reward_mean": 0.3, "eval/sampled_reward_level0": 0.5, "eval/sampled_reward_level2": 0.05,
             "eval/reward_mean": 0.6, "policy_version": 0}  # fmt: skip
    last = {"eval/sampled_reward_mean": 0.55, "eval/sampled_reward_level0": 0.8, "eval/sampled_reward_level2": 0.2,
            "eval/reward_mean": 0.7, "policy_version": 60}  # fmt: skip
    lines = before_after(first, last)
    assert lines[0] == (
        "held-out sampled reward 0.300 -> 0.550 (level0 0.50 -> 0.80, level2 0.05 -> 0.20) at policy version 0 -> 60"
    )
    assert lines[1].startswith("held-out greedy reward 0.600 -> 0.700")
    assert len(lines) == 2  # no exact-match figures given: no line for them
