"""A run that stops: a reward that fails or hangs, Ctrl-C (and the resume at K = 0), SIGTERM in
each phase and under DDP. Stops during engine start-up are in test_phases.py."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.conftest import SHRINK
from tests.e2e.runs import (
    start,
    train,
    trained_prompts,
    wait_for_training,
    wait_gone,
)

pytestmark = pytest.mark.e2e


def test_reward_failure_stops_the_run_cleanly(tmp_path, models):
    proc = start(
        tmp_path, models["tied"], "task._target_=tests.helpers.FailingRewardTask", "data.eval_size=0"
    )
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "RewardError" in err and "reward server unavailable" in err
    assert not wait_gone(proc.pid), "engine processes outlived the failed run"


def test_hanging_reward_is_killed_after_its_timeout(tmp_path, models):
    """data.reward_timeout_s: the hung call's worker process is killed, the run stops with
    the timeout named (reward_errors=fail), and no engine or reward process is left."""
    proc = start(
        tmp_path,
        models["tied"],
        "task._target_=tests.helpers.HangingRewardTask",
        "data.eval_size=0",
        "data.reward_timeout_s=2",
    )
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "RewardError" in err and "reward_timeout_s" in err
    assert not wait_gone(proc.pid), "engine or reward processes outlived the failed run"


def test_ctrl_c_stops_the_run_cleanly_and_resumes_at_k0(tmp_path, models):
    """Streaming with throttle at K = 0 (where the drift controller's halving ends; named, as
    async_grpo ships regenerate): Ctrl-C mid-run writes interrupted.ckpt and exits 130; resuming from it neither hangs (a batch in
    training at the interrupt used to hold the only slot K = 0 leaves) nor trains a prompt twice,
    and the batch in training at the interrupt is trained by the resumed run."""
    k0 = [
        "recipe=async_grpo",
        "rollout/staleness=throttle",
        "rollout.max_staleness=0",
        "+rollout.wait_timeout_s=60",
        "data.eval_size=0",
    ]
    first = tmp_path / "first"
    proc = start(
        first, models["tied"], *k0, "task._target_=tests.helpers.DigitShareTask", "trainer.max_steps=1000"
    )
    wait_for_training(proc, first)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # like a terminal Ctrl-C: the whole process group
    _, err = proc.communicate(timeout=120)
    print(f"FAULT-TIMING Ctrl-C -> exit {proc.returncode} in {time.monotonic() - t0:.2f} s")
    assert proc.returncode == 130, err[-4000:]
    ckpt = first / "checkpoints" / "interrupted.ckpt"
    assert ckpt.exists()
    assert not wait_gone(proc.pid), "engine processes outlived Ctrl-C"
    step = torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"]
    before = {p for b in trained_prompts(first) if b["version"] < step for p in b["prompt_ids"]}
    in_flight = [b["prompt_ids"] for b in trained_prompts(first) if b["version"] >= step][:1]
    second = tmp_path / "second"
    common = [*SHRINK, f"model.path={models['tied']}", "task._target_=tests.helpers.DigitShareTask"]
    train(second, *common, *k0, f"ckpt_path={ckpt}", f"trainer.max_steps={step + 2}")
    resumed = trained_prompts(second)
    assert [b["version"] for b in resumed] == [step, step + 1]
    trained_again = {p for b in resumed for p in b["prompt_ids"]}
    assert not before & trained_again  # nothing trained twice
    if in_flight:  # drawn before the interrupt, not trained: trained now
        assert set(in_flight[0]) <= trained_again


@pytest.mark.parametrize("phase", ["training", "evaluation", "shutdown"])
def test_sigterm_in_each_phase_stops_cleanly(tmp_path, models, phase):
    """SIGTERM (a scheduler's stop) to the trainer: mid-training, during the held-out evaluation
    before the first step (the task sends it when it scores a held-out row), and while the run
    shuts down (after the final evaluation: checkpoint, engine stop). Exit 143 with a
    checkpoint when something was trained and the stop came before the end; nothing left
    behind in any phase. (Start-up: test_phases.py.)"""
    task = "SigtermAtEvaluationTask" if phase == "evaluation" else "DigitShareTask"
    proc = start(
        tmp_path,
        models["tied"],
        f"task._target_=tests.helpers.{task}",
        f"trainer.max_steps={3 if phase == 'shutdown' else 1000}",
        *(["data.eval_size=0"] if phase == "training" else []),
    )
    t0 = time.monotonic()
    if phase == "training":
        wait_for_training(proc, tmp_path)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)  # what a scheduler sends to the main process
    elif phase == "shutdown":
        log = tmp_path / "train.log"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and "final held-out evaluation done" not in (
            log.read_text() if log.exists() else ""
        ):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.05)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    since = "the run's start" if phase == "evaluation" else "the signal"  # the task sends it
    print(
        f"FAULT-TIMING SIGTERM ({phase}) -> exit {proc.returncode}, {time.monotonic() - t0:.2f} s after {since}"
    )
    assert "Traceback" not in err, err[-3000:]
    if phase == "shutdown":  # the work is done: the shutdown finishes, as a shutdown or a stop
        assert proc.returncode in (0, 143), err[-3000:]
        assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    else:
        assert proc.returncode == 143, err[-3000:]
        assert (tmp_path / "checkpoints" / "interrupted.ckpt").exists()
    assert not wait_gone(proc.pid), f"engine processes outlived SIGTERM during {phase}"


def test_sigterm_under_ddp_stops_all_ranks_with_a_checkpoint(tmp_path, models):
    """trainer.devices=2: SIGTERM to rank 0 while the other rank waits in a collective; all
    ranks stop at the same step, rank 0 writes interrupted.ckpt, exit 143, nothing left."""
    proc = start(
        tmp_path,
        models["tied"],
        "task._target_=tests.helpers.DigitShareTask",
        "trainer.max_steps=1000",
        "data.eval_size=0",
        "trainer.devices=2",
    )
    wait_for_training(proc, tmp_path)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    print(f"FAULT-TIMING DDP SIGTERM -> exit {proc.returncode} in {time.monotonic() - t0:.2f} s")
    assert proc.returncode == 143, err[-3000:]
    assert "Connection closed by peer" not in err  # no rank crashed on the way out
    state = torch.load(tmp_path / "checkpoints" / "interrupted.ckpt", map_location="cpu", weights_only=False)
    assert state["asyncrl"]["policy_version"] >= 1
    assert not wait_gone(proc.pid), "processes outlived SIGTERM under DDP"
