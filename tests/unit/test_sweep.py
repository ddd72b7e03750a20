"""Hydra's Optuna sweeper with ``conf/sweep/optuna_testbed.yaml``: the search space composes and
every trial it can draw validates (fast), and a two-trial sweep through ``train.py`` with the
real engine runs its trials one after another in one process and reports the best one (e2e)."""

from __future__ import annotations

import pytest

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
