"""Every recipe end to end as a user types it: ``python train.py recipe=...`` on the real engine
(the SFT warm start without one), each documented logger, the delayed sync's exact lag."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, SHRINK
from tests.e2e.runs import (
    REQUIRED,
    train,
)

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("minibatches, lora_rank", [(1, 0), (2, 8)])
def test_sync_grpo_end_to_end(tmp_path, models, minibatches, lora_rank):
    """Sync GRPO on the real engine; the second run also trains LoRA adapters (rank 8) and
    pushes merged weights, which the verify pass checks against the trainer after each sync."""
    steps = 4
    rows = train(
        tmp_path,
        "recipe=sync_grpo",
        *SHRINK,
        f"model.path={models['tied']}",
        "task._target_=tests.helpers.DigitShareTask",
        f"trainer.max_steps={steps}",
        f"algo.minibatches={minibatches}",
        "callbacks.weight_sync.verify=true",
        f"model.lora.rank={lora_rank}",
        f"module.optimizer.lr={5e-3 if lora_rank else 5e-4}",
    )
    assert set(REQUIRED) <= set(rows[0].keys())
    train_rows = [r for r in rows if r["train/loss"]]
    assert [int(r["step"]) for r in train_rows] == list(range(steps))
    for r in train_rows:
        assert math.isfinite(float(r["train/loss"]))
        assert float(r["rollout/staleness_max"]) == 0  # sync: every token from the current version
    # one weight sync (version bump) per rollout batch = per `minibatches` optimizer steps
    versions = [int(float(r["rollout/policy_version"])) for r in train_rows]
    assert versions == [s // minibatches for s in range(steps)]
    # after every sync the engine scored a trained sequence like the trainer (verify=true)
    diffs = [float(r["perf/weight_sync_max_abs_diff"]) for r in train_rows[minibatches:]]
    assert diffs and max(diffs) < 1e-4
    # the step-time breakdown adds up to the step, and only a rollout batch's first step waits
    phases = ("gap", "wait", "prepare", "forward", "overhead", "backward", "optimizer")
    for i, r in enumerate(train_rows):
        parts = [float(r[f"perf/step_{p}_s"]) for p in phases]
        assert (
            min(parts) >= 0 and float(r["perf/step_forward_s"]) > 0 and float(r["perf/step_backward_s"]) > 0
        )
        assert sum(parts) == pytest.approx(float(r["perf/step_s"]), rel=1e-6, abs=1e-6)
        if i % minibatches:
            assert float(r["perf/step_wait_s"]) == 0.0
    # the policy really moved (nonzero advantages) and the trained model was saved
    before = load_file(models["tied"] / "model.safetensors")
    after = load_file(tmp_path / "hf_model" / "model.safetensors")
    assert set(after) == set(before)  # under LoRA too: the merged model, HF names
    changed = {k for k in before if (before[k] - after[k]).abs().max() > 0}
    assert changed
    if lora_rank:  # only the adapted projections moved; the adapter is saved on its own too
        assert all(k.endswith("proj.weight") for k in changed)
        assert (tmp_path / "hf_model" / "lora_adapter" / "adapter_model.safetensors").exists()
    summary = json.loads((tmp_path / "eval_summary.json").read_text())
    assert summary["first"]["step"] == 0 and summary["last"]["step"] == steps
    # make report renders the dashboard from this run's metrics.csv
    proc = subprocess.run(
        ["make", "report", f"RUN={tmp_path}", f"BIN={Path(sys.executable).parent}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # matplotlib on a loaded 2-core machine took > 120 s once
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    png = (tmp_path / "dashboard.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_delayed_sync_trains_at_exactly_k_versions_of_lag_under_the_monitor(tmp_path, models):
    """callbacks.weight_sync.lag=2 on the real engine: from the per-token versions the trainer
    sees, staleness is min(step, 2) at every step, in the loss's input and the rollout
    histogram alike; each delayed sync is verified against the trainer's logprobs with the
    delayed weights; the drift monitor waits out the ramp, then scores; the final evaluation
    is of the trained (flushed) policy."""
    steps = 8
    rows = train(
        tmp_path,
        "recipe=sync_grpo",
        *SHRINK,
        f"model.path={models['tied']}",
        "task._target_=tests.helpers.DigitShareTask",
        f"trainer.max_steps={steps}",
        "callbacks.weight_sync.lag=2",  # SHRINK evaluates every 2 served versions, too
        "callbacks/drift=monitor",
        "callbacks.drift.detector.warmup=3",
    )
    train_rows = [r for r in rows if r["train/loss"]]
    assert [int(r["step"]) for r in train_rows] == list(range(steps))
    for step, r in enumerate(train_rows):
        k = min(step, 2)
        assert float(r["rollout/staleness_max"]) == k == float(r["rollout/staleness_mean"])
        assert float(r[f"rollout/staleness_frac_{k}"]) == 1.0  # the experiences' own staleness
        assert float(r["train/grad_norm"]) > 0
    assert max(float(r["perf/weight_sync_max_abs_diff"]) for r in train_rows) < 1e-4
    # the per-sample records say the same, sample by sample
    recs = [json.loads(x) for x in (tmp_path / "experiences.jsonl").read_text().splitlines()]
    assert {(r["step"], r["staleness"], r["version"]) for r in recs} == {
        (s, min(s, 2), s) for s in range(steps)
    }
    assert all(r["spans"][0][0] == max(r["step"] - 2, 0) and r["gen_end"] >= r["gen_start"] for r in recs)
    scores = [float(r["drift/score"]) for r in train_rows]
    # steps 0-1 ramp, 2-4 fit the baseline: only the absolute ceilings score (far below the
    # threshold on a healthy run), then the relative score moves too
    assert all(0.0 <= x < 4.0 for x in scores[:5]) and all(math.isfinite(x) for x in scores)
    # the entropy: a relative signal of the default detector that a bypass run has (its ESS is 1)
    z_entropy = [float(r.get("drift/z/train/entropy") or 0.0) for r in train_rows]
    assert not any(z_entropy[:5]) and any(z_entropy[5:])  # scored once the baseline is fitted
    summary = json.loads((tmp_path / "eval_summary.json").read_text())
    # evaluations are labelled with the version the engine served; the last one is after the flush
    assert [h["policy_version"] for h in summary["history"]] == [0, 2, 4, 6, steps]
    from tools.report import render  # the dashboard's drift panel draws from this run

    png = render(tmp_path, tmp_path / "dashboard.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_sft_warmup_smoke(tmp_path, models):
    out_model = tmp_path / "sft-model"
    rows = train(
        tmp_path,
        "recipe=sft_warmup",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "data.train_size=256",
        "data.eval_size=16",
        "data.batch_size=16",
        f"model.base_path={models['tied']}",
        f"model.path={out_model}",
    )
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert any(r.get("eval/reward_mean") for r in rows)
    assert (out_model / "config.json").exists() and (out_model / "tokenizer.json").exists()


REPLICAS = {"async_grpo": ["engine.replicas=2", "engine.cpu_cores=0-1", "engine.pin_trainer=false"]}
# async_grpo's bound at K = 1, so that 4 steps can test it (its K = 4 needs 5 versions to bind)
BOUND = {"async_grpo": ["rollout.max_staleness=1"]}


# Each documented logger writes its records offline in one of the recipe runs below.
LOGGERS = {"partial_grpo": "mlflow", "ppo": "tensorboard", "dapo": "wandb"}


def assert_logged(run_dir: Path, logger: str) -> None:
    """The run's loss reached the logger's own store (besides metrics.csv)."""
    if logger == "tensorboard":
        events = list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
        assert events and events[0].stat().st_size > 100, events
    elif logger == "wandb":
        runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
        assert runs and runs[0].stat().st_size > 1000, list((run_dir / "wandb").rglob("*"))
    else:
        import mlflow

        client = mlflow.tracking.MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
        exp = client.get_experiment_by_name("asyncrl")
        (run,) = client.search_runs([exp.experiment_id])
        assert "train/loss" in run.data.metrics and run.info.status == "FINISHED"


@pytest.mark.parametrize("recipe", ["async_grpo", "partial_grpo"])
def test_async_recipes_end_to_end(tmp_path, models, recipe):
    steps = 4
    rows = train(
        tmp_path,
        f"recipe={recipe}",
        *SHRINK,
        f"model.path={models['tied']}",
        "task._target_=tests.helpers.DigitShareTask",
        f"trainer.max_steps={steps}",
        *REPLICAS.get(recipe, []),
        *BOUND.get(recipe, []),
        *([f"logger={LOGGERS[recipe]}"] if recipe in LOGGERS else []),
    )
    if recipe in LOGGERS:
        assert_logged(tmp_path, LOGGERS[recipe])
    train_rows = [r for r in rows if r["train/loss"]]
    assert [int(r["step"]) for r in train_rows] == list(range(steps))
    assert all(math.isfinite(float(r["train/loss"])) for r in train_rows)
    assert [int(float(r["rollout/policy_version"])) for r in train_rows] == list(range(steps))
    assert max(float(r["perf/weight_sync_max_abs_diff"]) for r in train_rows[1:]) < 1e-4
    if recipe == "async_grpo":  # regenerate (at K = 1 here): nothing dropped, nothing past K
        last = [r for r in train_rows if r.get("rollout/dropped")][-1]
        assert float(last["rollout/dropped"]) == 0
        assert max(float(r["rollout/staleness_max"]) for r in train_rows) <= 1
        assert float(last.get("rollout/over_bound") or 0) == 0
    assert "rollout/inflight" in rows[0] and "rollout/buffer_size" in rows[0]
    if recipe in REPLICAS:  # both replicas generated, and every sync was verified on both
        last = [r for r in rows if r.get("perf/engine1/requests")][-1]
        assert float(last["perf/engine0/requests"]) > 0 and float(last["perf/engine1/requests"]) > 0


def test_agent_recipe_trains_on_multi_turn_episodes(tmp_path, models):
    """recipe=agent_calculator (streaming, an environment with a tool) on the random model:
    episodes of up to three turns, each observation between its turn and the next, per-turn
    metrics, verified syncs, and each turn's span and versions in experiences.jsonl."""
    rows = train(
        tmp_path,
        "recipe=agent_calculator",
        *SHRINK,
        f"model.path={models['tied']}",
        "env._target_=tests.helpers.EveryTurnAnswered",
        "env.max_turn_tokens=6",
        "trainer.max_steps=3",
    )
    train_rows = [r for r in rows if r["train/loss"]]
    assert len(train_rows) == 3 and all(math.isfinite(float(r["train/loss"])) for r in train_rows)
    assert max(float(r["perf/weight_sync_max_abs_diff"]) for r in train_rows[1:]) < 1e-4
    for r in train_rows:  # a turn the model ends with EOS ends its episode early
        assert 1 <= float(r["env/turns_mean"]) <= 3 and float(r["env/observation_tokens_mean"]) > 0
        assert float(r["train/reward_mean"]) == pytest.approx(0.25 * float(r["env/turns_mean"]))
    assert any(r.get("eval/turns") for r in rows)  # held-out episodes too
    lines = [json.loads(x) for x in (tmp_path / "experiences.jsonl").read_text().splitlines()]
    assert max(len(line["turns"]) for line in lines) == 3
    for line in lines:
        turns = line["turns"]
        assert line["reward"] == pytest.approx(0.25 * len(turns)) and turns[0]["span"][0] == 0
        for turn, after in zip(turns, turns[1:]):  # model turn, its observation, the next turn
            assert turn["versions"] and turn["span"][1] == turn["observation"][0]
            assert after["span"][0] == turn["observation"][1] > turn["observation"][0]


@pytest.mark.parametrize("recipe", ["ppo", "dapo"])
def test_knob_recipes_end_to_end(tmp_path, models, recipe):
    """recipe=ppo (a critic beside the policy, one response per prompt) and recipe=dapo (dynamic
    sampling, soft overlong punishment, clip-higher) train with verified syncs and report their
    metrics, to TensorBoard and W&B (offline) besides metrics.csv."""
    rows = train(
        tmp_path,
        f"recipe={recipe}",
        *SHRINK,
        f"model.path={models['tied']}",
        "task._target_=tests.helpers.DigitShareTask",
        "trainer.max_steps=2",
        f"logger={LOGGERS[recipe]}",
        # ppo: one response per prompt (the critic's advantages need no group)
        *(
            ["rollout.overlong.buffer=16"]
            if recipe == "dapo"
            else ["module.critic.lr=1e-3", "rollout.group_size=1"]
        ),
    )
    assert_logged(tmp_path, LOGGERS[recipe])
    train_rows = [r for r in rows if r["train/loss"]]
    assert len(train_rows) == 2 and all(math.isfinite(float(r["train/loss"])) for r in train_rows)
    assert max(float(r["perf/weight_sync_max_abs_diff"]) for r in train_rows[1:]) < 1e-4
    if recipe == "ppo":
        assert all(math.isfinite(float(r["critic/value_mean"])) for r in train_rows)
        state = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
        assert any(k.startswith("critic.model.head") for k in state["state_dict"])  # checkpointed
    else:
        assert float(train_rows[-1]["rollout/groups_sampled_per_trained"]) >= 1.0
        assert "rollout/filtered" in train_rows[-1]


@pytest.mark.parametrize("policy", ["fail", "zero"])
def test_an_environment_that_raises_stops_the_run_or_is_counted(tmp_path, models, policy):
    """data.reward_errors applies to environments: ``fail`` stops the run with one error naming
    the environment, the method and the prompt; ``zero`` scores the episode 0 and counts it
    (env/env_errors, env_errors in experiences.jsonl)."""
    overrides = [
        "recipe=agent_calculator",
        *SHRINK,
        f"model.path={models['tied']}",
        "env._target_=tests.helpers.StepFailsOnOddPrompts",
        "env.max_turn_tokens=6",
        "trainer.max_steps=2",
        "data.eval_size=0",
        f"data.reward_errors={policy}",
    ]
    if policy == "fail":
        proc = subprocess.run(
            [sys.executable, "train.py", f"hydra.run.dir={tmp_path}", *overrides],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 1
        assert "StepFailsOnOddPrompts failed in step on prompt id" in proc.stderr + proc.stdout
        return
    rows = [r for r in train(tmp_path, *overrides) if r["train/loss"]]
    assert sum(float(r["env/env_errors"]) for r in rows) > 0
    lines = [json.loads(x) for x in (tmp_path / "experiences.jsonl").read_text().splitlines()]
    failed = [line for line in lines if line["prompt_id"] % 2]
    assert failed and all(line["env_errors"] >= 1 and line["reward"] == 0.0 for line in failed)
