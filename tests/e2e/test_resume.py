"""kill -9 and resume, in sync and streaming mode (also with multi-turn episodes in flight):
nothing outlives the kill, no prompt is lost or trained twice."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import DEFAULT_EXECUTOR, SHRINK
from tests.e2e.runs import (
    kill_9_after_a_checkpoint,
    train,
    trained_prompts,
)

pytestmark = pytest.mark.e2e


def test_kill_9_and_resume_continues_without_losing_or_repeating_prompts(tmp_path, models):
    """Sync mode: kill -9 of the trainer alone after a checkpoint (the reaper takes the engine
    down: nothing outlives it), resume from it; the version continues and the resumed run
    trains exactly the prompts the original run would have trained next."""
    common = [
        "recipe=sync_grpo",
        *SHRINK,
        f"model.path={models['tied']}",
        "task._target_=tests.helpers.DigitShareTask",
        "callbacks.checkpoint.every_n_train_steps=2",
        "data.eval_size=0",
    ]
    first = tmp_path / "first"
    # the default executor: the engine's worker in a process of its own, as users run it
    ckpt = kill_9_after_a_checkpoint(first, [*common, DEFAULT_EXECUTOR], trainer_only=True)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    step = state["global_step"]
    assert step >= 2 and state["asyncrl"]["policy_version"] == step
    rng = state["asyncrl"]["rng"]  # RNG states and the minibatch-shuffle state travel too
    assert {"python", "numpy", "torch"} <= rng.keys()
    assert len(state["RolloutDataModule"]["shuffle_rng"][1]) == 625  # Mersenne Twister state
    before = trained_prompts(first)
    second = tmp_path / "second"
    rows = train(second, *common, f"ckpt_path={ckpt}", f"trainer.max_steps={step + 2}")
    versions = [int(float(r["rollout/policy_version"])) for r in rows if r.get("train/loss")]
    assert versions == [step, step + 1]  # the version continues from the checkpoint
    # the engine started from the checkpoint's weights: verified at the first sync
    assert float(rows[0]["perf/weight_sync_max_abs_diff"]) < 1e-4
    resumed = trained_prompts(second)
    assert [b["version"] for b in resumed] == [step, step + 1]
    # the killed run's batches after the checkpoint are exactly what the resumed run trains
    after_ckpt = [b["prompt_ids"] for b in before if b["version"] >= step][:2]
    assert [b["prompt_ids"] for b in resumed][: len(after_ckpt)] == after_ckpt
    seen = {p for b in before if b["version"] < step for p in b["prompt_ids"]}
    assert not seen & {p for b in resumed for p in b["prompt_ids"]}  # nothing trained twice
    print(
        f"RESUME-ACCOUNTING checkpoint at step {step}; killed run trained {len(before)} batches "
        f"({sum(len(b['prompt_ids']) for b in before)} prompt ids); resumed run: "
        f"{[len(b['prompt_ids']) for b in resumed]} prompts per batch, identical to the killed "
        f"run's batches after the checkpoint for {len(after_ckpt)} of them, 0 repeats"
    )


K = 2  # the bound for the streaming resume: small, so few steps guarantee the re-queued are trained
EPISODES = ["env=calculator", "env._target_=tests.helpers.EveryTurnAnswered", "env.max_turn_tokens=6"]


@pytest.mark.parametrize("episodes", [False, True], ids=["one_turn", "episodes"])
def test_kill_9_and_resume_in_streaming_mode_loses_and_repeats_no_prompt(tmp_path, models, episodes):
    """Streaming with a bound that drops nothing (admission control; with ``episodes``,
    ``regenerate``, whose re-queued prompts must survive the checkpoint too): kill -9 after a
    checkpoint, resume.
    Every prompt the killed run had drawn before the checkpoint is either trained before it
    or re-queued in it (its group was generating or buffered), the re-queued ones are trained
    by the resumed run, and no prompt trained before the checkpoint is trained again. With
    ``episodes``: three-turn episodes, some mid-flight (between turns, or waiting on their
    environment) when the checkpoint is taken; they are restarted from their prompts."""
    import random

    common = [
        "recipe=async_grpo",
        f"rollout/staleness={'regenerate' if episodes else 'admit'}",
        f"rollout.max_staleness={K}",
        *SHRINK,
        f"model.path={models['tied']}",
        "task._target_=tests.helpers.DigitShareTask",
        "callbacks.checkpoint.every_n_train_steps=2",
        "data.eval_size=0",
        *(EPISODES if episodes else []),
    ]
    first = tmp_path / "first"
    ckpt = kill_9_after_a_checkpoint(first, common)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    step = state["global_step"]
    prompts = state["RolloutDataModule"]["prompts"]
    assert prompts["epoch"] == 0
    order = list(range(256))  # data.train_size=256 in SHRINK: row id = index
    random.Random(0 * 7919 + 0).shuffle(order)  # PromptStream's epoch-0 order for seed 0
    drawn = set(order[: prompts["cursor"]])
    requeued = set(prompts["front"])
    before = trained_prompts(first)
    trained_before = [p for b in before if b["version"] < step for p in b["prompt_ids"]]
    assert len(trained_before) == len(set(trained_before))
    assert requeued and not requeued & set(trained_before)
    assert drawn == set(trained_before) | requeued  # 0 prompts lost at the checkpoint
    second = tmp_path / "second"
    # Re-queued prompts are started first, at most 4 (prompts_per_step) a version once the
    # in-flight groups leave room; the bound trains each within K versions of its start, and
    # under regenerate one more start (max_regenerations=1) may come K + 1 versions later.
    # Enough steps for that, whatever order the groups finish in (no timing assumed).
    starts = -(-len(requeued) // 4)
    extra = starts + (K + 1) * (2 if episodes else 1)
    train(second, *common, f"ckpt_path={ckpt}", f"trainer.max_steps={step + extra}")
    resumed = [p for b in trained_prompts(second) for p in b["prompt_ids"]]
    if episodes:  # the resumed run trained episodes (the first one's, too)
        for run in (first, second):
            lines = (run / "experiences.jsonl").read_text().splitlines()
            assert max(len(json.loads(x)["turns"]) for x in lines) == 3
    assert not set(resumed) & set(trained_before)  # 0 trained twice
    assert requeued <= set(resumed)  # the re-queued prompts were trained after the resume
    assert len(resumed) == len(set(resumed))
    print(
        f"STREAMING-RESUME checkpoint at step {step}: {len(trained_before)} prompts trained before "
        f"it, {len(requeued)} re-queued, 0 lost; resumed run trained {len(resumed)} prompts, "
        f"all {len(requeued)} re-queued among them, 0 repeats"
    )
