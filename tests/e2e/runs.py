"""Helpers of the e2e tier: ``train.py`` as a subprocess, its process tree, kill -9 after a
checkpoint, a multirun as a user types it."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import ROOT, SHRINK

REQUIRED = [
    "train/reward_mean",
    "train/loss",
    "train/clip_frac",
    "train/kl_behavior",
    "train/entropy",
    "train/response_len_mean",
    "rollout/policy_version",
    "perf/samples_per_s",
    "perf/weight_sync_s",
    "perf/trainer_idle_frac",
    "perf/engine_idle_frac",
    "eval/reward_mean",
]


def train(run_dir: Path, *overrides: str) -> list[dict[str, str]]:
    proc = subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    console = proc.stdout + proc.stderr
    # the console shows our messages, not vLLM's per-sync reload or cast warnings, and the engine
    # exits on its own at shutdown (not force-killed)
    assert "Failed to load weights" not in console and "force killing" not in console
    assert "Attempted to load weight" not in console  # a bf16 engine's per-tensor casts (quiet.py)
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def session_processes(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return out


def wait_gone(sid: int, seconds: float = 30) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    while (alive := session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def start(tmp_path: Path, model: Path, *overrides: str) -> subprocess.Popen:
    """train.py in its own session (so its whole process tree can be found afterwards)."""
    cmd = [
        sys.executable,
        "train.py",
        f"hydra.run.dir={tmp_path}",
        "recipe=sync_grpo",
        *SHRINK,
        f"model.path={model}",
        *overrides,
    ]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    """Ctrl-C as from a terminal: a test suite started in the background (``cmd &`` from a
    non-interactive shell) inherits SIGINT ignored, and the trainer would then ignore the
    Ctrl-C the test sends while the engine core dies of it (exit 1 instead of 130)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for_training(proc: subprocess.Popen, run_dir: Path, rows: int = 2) -> None:
    """Block until the run has logged ``rows`` training rows (it must not exit meanwhile)."""
    metrics = run_dir / "metrics.csv"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") > rows):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.5)


def trained_prompts(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]


def kill_9_after_a_checkpoint(run_dir: Path, overrides: list[str], trainer_only: bool = False) -> Path:
    """Train until a checkpoint exists and 5 rollout batches ran, kill -9 the whole process
    group (trainer and engine), check nothing survived; the checkpoint's path. ``trainer_only``:
    kill the trainer alone (no chance to shut anything down): vLLM's engine core does not notice
    its parent's death, and modules/engine/reaper.py must kill it."""
    proc = subprocess.Popen(
        [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *overrides, "trainer.max_steps=1000"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    while time.monotonic() < deadline and not (ckpt.exists() and len(trained_prompts(run_dir)) >= 5):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.2)
    if trainer_only:
        others = [p for p in session_processes(proc.pid) if p.pid != proc.pid]
        assert any("EngineCore" in " ".join(p.cmdline()) or "VLLM" in p.name() for p in others)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not wait_gone(proc.pid), "engine processes outlived kill -9"
    if trainer_only:
        print(f"FAULT-TIMING trainer SIGKILL -> engine processes gone in {time.monotonic() - t0:.2f} s")
    return ckpt


def multirun(sweep_dir: Path, models: dict, *overrides: str) -> None:
    """``train.py -m`` of the shrunk sync recipe into ``sweep_dir``; it must exit 0. As a user
    types it: from another directory, without the PROJECT_ROOT that make and conftest export
    (with trainer.devices=2 too: Lightning relaunches rank 1 from the same command line)."""
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", f"hydra.sweep.dir={sweep_dir}", "recipe=sync_grpo"]
    cmd += [*SHRINK, f"model.path={models['tied']}", "task._target_=tests.helpers.DigitShareTask"]
    env = {k: v for k, v in os.environ.items() if k != "PROJECT_ROOT"}
    proc = subprocess.run(
        [*cmd, "data.eval_size=0", *overrides],
        cwd=sweep_dir.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
