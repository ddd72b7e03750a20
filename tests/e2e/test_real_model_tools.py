"""The real chat model's tool recipes as a user types them, shrunk to 2 steps each:
``recipe=smollm2_sft_tools`` writes a warm start (into the test's directory), and
``recipe=smollm2_tools`` runs tool episodes from it (a bf16 engine, the five-token stop string
``</tool_call>``, observations as the template's tool turn), syncs its weights and evaluates
call validity and reward per level; every trained episode is prompt + model ids + observation
ids, with the observations out of the loss."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import ROOT
from tests.e2e.runs import train

pytestmark = pytest.mark.e2e

SMOLLM2 = ROOT / "artifacts" / "smollm2-135m-instruct"


def test_smollm2_tool_recipes_two_steps_each(tmp_path):
    assert (SMOLLM2 / "config.json").is_file(), "run `make smollm2` (make install does)"
    warm = tmp_path / "warm"
    rows = train(
        tmp_path / "sft",
        "recipe=smollm2_sft_tools",
        f"model.path={warm}",
        "trainer.max_steps=2",
        "data.train_size=8",
        "data.batch_size=4",
    )
    assert [int(r["step"]) for r in rows if r.get("train/loss")][-1] == 1
    assert (warm / "config.json").is_file() and (warm / "chat_template.jinja").is_file()
    run = tmp_path / "rl"
    rows = train(
        run,
        "recipe=smollm2_tools",
        f"model.path={warm}",
        "trainer.max_steps=2",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "data.train_size=32",
        "data.eval_size=3",
        "data.eval_samples=1",
        "engine.executor=uni",
        "callbacks.checkpoint.every_n_train_steps=2",
    )
    steps = [r for r in rows if r.get("train/loss")]
    assert [int(r["step"]) for r in steps] == [0, 1]
    assert all(math.isfinite(float(r["train/loss"])) for r in steps)
    assert float(steps[-1]["perf/weight_sync_max_abs_diff"]) < 1.0  # the bf16 engine's tolerance
    summary = json.loads((run / "eval_summary.json").read_text())
    for key in ("eval/reward_level0", "eval/sampled_reward_level1", "eval/turns", "eval/tool_calls"):
        assert key in summary["first"] and key in summary["last"], key
    lines = [json.loads(x) for x in (run / "experiences.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * 4
    for line in lines:  # each model turn's span and its observation's, within the episode
        assert line["turns"] and all(0 <= t["span"][0] <= t["span"][1] <= line["len"] for t in line["turns"])
        assert all(t["observation"][1] <= line["len"] for t in line["turns"])
