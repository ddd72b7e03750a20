"""``python train.py`` end to end with the real engine (and the SFT recipe without one)."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import DEFAULT_EXECUTOR, ROOT, SHRINK

pytestmark = pytest.mark.e2e

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
    # the console shows our messages, not vLLM's per-sync reload warnings, and the engine
    # exits on its own at shutdown (not force-killed)
    assert "Failed to load weights" not in console and "force killing" not in console
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


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
    """Streaming with throttle at K = 0 (where the drift controller's halving ends): Ctrl-C
    mid-run writes interrupted.ckpt and exits 130; resuming from it neither hangs (a batch in
    training at the interrupt used to hold the only slot K = 0 leaves) nor trains a prompt twice,
    and the batch in training at the interrupt is trained by the resumed run."""
    k0 = ["recipe=async_grpo", "rollout.max_staleness=0", "+rollout.wait_timeout_s=60", "data.eval_size=0"]
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
        while time.monotonic() < deadline and "held-out sampled reward" not in (
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


REPLICAS = {"async_grpo": ["engine.replicas=2", "engine.cpu_cores=0-1", "engine.pin_trainer=false"]}
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
        *([f"logger={LOGGERS[recipe]}"] if recipe in LOGGERS else []),
    )
    if recipe in LOGGERS:
        assert_logged(tmp_path, LOGGERS[recipe])
    train_rows = [r for r in rows if r["train/loss"]]
    assert [int(r["step"]) for r in train_rows] == list(range(steps))
    assert all(math.isfinite(float(r["train/loss"])) for r in train_rows)
    assert [int(float(r["rollout/policy_version"])) for r in train_rows] == list(range(steps))
    assert max(float(r["perf/weight_sync_max_abs_diff"]) for r in train_rows[1:]) < 1e-4
    if recipe == "async_grpo":  # throttle, K = 2: nothing dropped; a group past K is counted
        last = [r for r in train_rows if r.get("rollout/dropped")][-1]
        assert float(last["rollout/dropped"]) == 0
        if max(float(r["rollout/staleness_max"]) for r in train_rows) > 2:
            assert float(last["rollout/over_bound"]) > 0
    assert "rollout/inflight" in rows[0] and "rollout/buffer_size" in rows[0]
    if recipe in REPLICAS:  # both replicas generated, and every sync was verified on both
        last = [r for r in rows if r.get("perf/engine1/requests")][-1]
        assert float(last["perf/engine0/requests"]) > 0 and float(last["perf/engine1/requests"]) > 0


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


@pytest.fixture(scope="module")
def ddp_sweep(tmp_path_factory, models) -> Path:
    """One ``train.py -m seed=0,1 trainer.devices=2`` sweep of 3 steps a job, shared by the DDP
    tests below (each DDP job costs an engine start-up and a relaunched rank)."""
    sweep = tmp_path_factory.mktemp("ddp_sweep")
    multirun(
        sweep,
        models,
        f"trainer.max_steps={DDP_STEPS}",
        "trainer.devices=2",
        "seed=0,1",
        "+callbacks.zz_probe._target_=tests.ddp_probe.DumpRankWeights",
    )
    return sweep


DDP_STEPS = 3


def test_ddp_two_ranks_train_disjoint_shards_and_agree_with_the_engine(ddp_sweep, models):
    """trainer.devices=2 on the CPU (gloo): rank 0 owns the engine and scatters each rollout
    batch; both ranks train on disjoint halves and end with identical weights, which are the
    weights the engine serves."""
    steps, run_dir = DDP_STEPS, ddp_sweep / "0"
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    train_rows = [r for r in rows if r["train/loss"]]
    assert [int(r["step"]) for r in train_rows] == list(range(steps))
    assert all(float(r["perf/rank_weight_max_diff"]) == 0.0 for r in train_rows)
    # 4 prompts x 4 samples per rollout batch: each rank trained 8, no sample on both ranks
    full = [json.loads(x) for x in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    shards = {
        r: [json.loads(x) for x in (run_dir / f"trained_samples.rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    }
    assert len(full) == len(shards[0]) == len(shards[1]) == steps
    for k in range(steps):
        a = {tuple(s) for s in shards[0][k]["samples"]}
        b = {tuple(s) for s in shards[1][k]["samples"]}
        assert len(a) == len(b) == 8 and not a & b
        assert a | b == {tuple(s) for s in full[k]["samples"]}
    # identical weights on both ranks, changed by training, equal to the engine's
    w0 = torch.load(run_dir / "weights.rank0.pt")
    w1 = torch.load(run_dir / "weights.rank1.pt")
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    before = load_file(models["tied"] / "model.safetensors")
    assert any((before[k] - w0[k]).abs().max() > 0 for k in before)
    engine = json.loads((run_dir / "engine_diff.json").read_text())
    assert engine["engine_version"] == steps and engine["engine_max_abs_diff"] < 1e-4


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


def test_multirun_of_three_jobs_leaks_no_threads_processes_or_memory(tmp_path, models):
    """``python train.py -m`` runs its jobs one after another in one process: after each job
    the engine is gone (0 children), the thread count is back to where it was, and the
    resident memory does not keep growing from job to job (three jobs: the first pays one-off
    imports, the second and third must agree)."""
    multirun(tmp_path, models, "trainer.max_steps=2", "seed=0,1,2")
    footprints = []
    for job in range(3):
        line = next(
            x
            for x in (tmp_path / str(job) / "train.log").read_text().splitlines()
            if "process after job" in x
        )
        footprints.append(dict(kv.split("=") for kv in line.split("process after job: ")[1].split()))
    assert [int(f["children"]) for f in footprints] == [0, 0, 0]
    threads = [int(f["threads"]) for f in footprints]
    assert threads == [threads[0]] * 3, threads
    rss = [int(f["rss_mb"]) for f in footprints]
    # the first job pays one-off imports; after it (heap trimmed after each job) no trend
    assert rss[2] - rss[1] < 50, rss


def test_multirun_with_ddp_trains_each_job_once_on_two_ranks(ddp_sweep):
    """``-m seed=0,1 trainer.devices=2``: Lightning relaunches rank 1 from ``sys.argv``, which in
    a multirun still holds the sweep (``modules/launch/multirun.py``); each job must run once, on two
    ranks, in its own directory (a job run twice would log twice its steps)."""
    assert sorted(p.name for p in ddp_sweep.iterdir() if p.is_dir()) == ["0", "1"]
    for job in ("0", "1"):
        for rank in (0, 1):
            lines = (ddp_sweep / job / f"trained_samples.rank{rank}.jsonl").read_text().splitlines()
            assert len(lines) == DDP_STEPS, (job, rank, lines)


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
    extra = 2 + len(requeued) // 4
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
