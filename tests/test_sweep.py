"""Hydra's Optuna sweeper with ``conf/sweep/optuna_testbed.yaml``: the search space composes and
every trial it can draw validates (fast), and a two-trial sweep through ``train.py`` with the
real engine runs its trials one after another in one process and reports the best one (e2e)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from modules.launch.multirun import job_argv
from modules.launch.validate import validate
from tests.conftest import ROOT, compose

SWEEP = "+sweep=optuna_testbed"
SEARCHED = ("module.optimizer.lr", "algo.objective.eps_low", "rollout.max_staleness")


def hydra_config(overrides: list[str]):
    """The ``hydra`` node of the composed config (``compose`` leaves it out)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return hydra_compose("train", overrides=overrides, return_hydra_config=True).hydra
    finally:
        GlobalHydra.instance().clear()


def search_space() -> dict:
    """The sweep's parameters as the Optuna sweeper reads them (name -> distribution)."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    params = hydra_config([SWEEP]).sweeper.params
    distributions, fixed = create_params_from_overrides([f"{k}={v}" for k, v in params.items()])
    assert not fixed
    return distributions


def test_sweep_config_selects_the_optuna_sweeper_and_maximizes():
    sweeper = hydra_config([SWEEP]).sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "maximize"
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler" and sweeper.n_jobs == 1
    assert tuple(sweeper.params) == SEARCHED


def test_search_space_is_lr_x_clip_x_integer_staleness():
    import optuna.distributions as d

    space = search_space()
    lr, clip, k = (space[name] for name in SEARCHED)
    assert isinstance(lr, d.LogUniformDistribution) and (lr.low, lr.high) == (1e-4, 2e-3)
    assert isinstance(clip, d.UniformDistribution) and (clip.low, clip.high) == (0.1, 0.3)
    # an int distribution: a float K would be refused by validate (rollout.max_staleness: int)
    assert isinstance(k, d.IntUniformDistribution) and (k.low, k.high) == (1, 4)


@pytest.mark.parametrize("corner", ["low", "high"])
def test_every_corner_of_the_search_space_validates(corner):
    """A trial is the sweep config plus ``name=value`` per parameter: at both ends of every
    range the config composes, validates, runs streaming GRPO and clips symmetrically."""
    values = {name: getattr(dist, corner) for name, dist in search_space().items()}
    cfg = compose([SWEEP, *(f"{k}={v}" for k, v in values.items())])
    validate(cfg)
    assert cfg.rollout._target_.endswith("StreamingRollout")
    assert cfg.module.optimizer.lr == values["module.optimizer.lr"]
    assert cfg.algo.objective.eps_high == cfg.algo.objective.eps_low == values["algo.objective.eps_low"]
    assert cfg.rollout.max_staleness == values["rollout.max_staleness"]
    assert cfg.task._target_.endswith("RemainderTask")  # the testbed


def test_ddp_children_of_a_trial_rerun_that_trial_only():
    """Lightning relaunches DDP ranks from ``sys.argv`` (modules/launch/multirun.py): for an Optuna
    trial that is the trial's own overrides, the sweep config kept, no ``-m``, no sweeper keys."""
    argv = ["train.py", "-m", SWEEP, "hydra.sweeper.n_trials=2", "trainer.devices=2"]
    trial = ["module.optimizer.lr=0.0003", "algo.objective.eps_low=0.15", "rollout.max_staleness=2"]
    out = job_argv(
        argv, [*trial, SWEEP, "trainer.devices=2"], ["hydra.sweeper.n_trials=2", "hydra.mode=MULTIRUN"]
    )
    assert out == ["train.py", *trial, SWEEP, "trainer.devices=2"]


@pytest.mark.e2e
def test_two_trial_optuna_sweep_through_train_py(tmp_path: Path, models):
    """``python train.py -m +sweep=optuna_testbed`` with two trials of one step each: both run
    (one engine each, gone after its job), each returns a finite metric, and Optuna writes the
    best trial's parameters, which are one of the two trials'."""
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        SWEEP,
        f"hydra.sweep.dir={tmp_path}",
        "hydra.sweeper.n_trials=2",
        "trainer.max_steps=1",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.sampling.max_tokens=32",
        "data.eval_size=4",
        "data.train_size=64",
        f"model.path={models['tied']}",
        "task._target_=tests.helpers.DigitShareTask",  # a continuous reward: the trials differ
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    trials = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert [p.name for p in trials] == ["0", "1"]
    metrics, params = [], []
    for job in trials:
        last = json.loads((job / "eval_summary.json").read_text())["last"]
        metrics.append(last["eval/sampled_reward_mean"])
        assert math.isfinite(metrics[-1]) and last["policy_version"] == 1
        overrides = dict(o.split("=", 1) for o in yaml.safe_load((job / ".hydra/overrides.yaml").read_text()))
        params.append({k: overrides[k] for k in SEARCHED})
        footprint = next(x for x in (job / "train.log").read_text().splitlines() if "process after job" in x)
        assert "children=0" in footprint  # the trial's engine is gone before the next trial
        job_cfg = yaml.safe_load((job / ".hydra/config.yaml").read_text())
        assert job_cfg["rollout"]["max_staleness"] == int(params[-1]["rollout.max_staleness"])
    assert params[0] != params[1]

    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert results["name"] == "optuna" and set(results["best_params"]) == set(SEARCHED)
    assert math.isclose(results["best_value"], max(metrics), rel_tol=1e-6)
    # train.py returns a float32 metric and eval_summary.json holds the float64: trials within
    # that rounding are a tie, and Optuna may name either of them as the best
    tied = [p for p, m in zip(params, metrics) if math.isclose(m, results["best_value"], rel_tol=1e-6)]
    assert {k: str(v) for k, v in results["best_params"].items()} in tied
