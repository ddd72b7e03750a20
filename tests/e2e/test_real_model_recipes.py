"""The real chat model's recipes as a user types them, shrunk to 2 rollout batches: ``recipe=smollm2_grpo``
(SmolLM2-135M-Instruct, its chat template, a float32 engine, a bf16-mixed trainer) trains, syncs
its weights to the engine and evaluates per level; the prompts the engine completed are the
chat template's, and the console carries no per-tensor cast warnings."""

from __future__ import annotations

import json
import math

import pytest
from transformers import AutoTokenizer

from tests.conftest import ROOT
from tests.e2e.runs import train

pytestmark = pytest.mark.e2e

SMOLLM2 = ROOT / "artifacts" / "smollm2-135m-instruct"
TINY = [
    "trainer.max_steps=4",  # 2 rollout batches of 2 minibatches
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.sampling.max_tokens=24",
    "rollout.overlong.buffer=8",
    "data.train_size=64",
    "data.eval_size=6",
    "data.eval_samples=1",
    "data.eval_max_tokens=24",
    "engine.executor=uni",
    "callbacks.checkpoint.every_n_train_steps=2",
]


def test_smollm2_grpo_two_steps(tmp_path):
    assert (SMOLLM2 / "config.json").is_file(), "run `make smollm2` (make install does)"
    rows = train(tmp_path, "recipe=smollm2_grpo", *TINY)
    steps = [r for r in rows if r.get("train/loss")]
    assert [int(r["step"]) for r in steps] == [0, 1, 2, 3]
    assert all(math.isfinite(float(r["train/loss"])) for r in steps)
    # a weight sync after each rollout batch, verified: the float32 engine scores a trained
    # sequence as the trainer does (callbacks.weight_sync.verify, 1e-3)
    assert float(steps[-1]["perf/weight_sync_s"]) > 0
    assert float(steps[-1]["perf/weight_sync_max_abs_diff"]) < 1e-3
    # held-out reward per level, greedy and sampled, first and last evaluation
    summary = json.loads((tmp_path / "eval_summary.json").read_text())
    for key in ("eval/reward_level0", "eval/sampled_reward_level0"):
        assert key in summary["first"] and key in summary["last"]
    # every trained prompt is the chat template's rendering of its word problem (its length)
    from data.tasks.word_problems import WordProblemsTask
    from modules.policy.prompt_format import ChatTemplate

    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    task, fmt = WordProblemsTask(), ChatTemplate()
    rows_by_id = {r["id"]: r for r in task.build("train", 64)}
    lines = [json.loads(x) for x in (tmp_path / "experiences.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * 4
    for line in lines:
        assert line["prompt_len"] == len(fmt.ids(tok, task.prompt_text(rows_by_id[line["prompt_id"]])))
        assert line["level"] == rows_by_id[line["prompt_id"]]["level"]
