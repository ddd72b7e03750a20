"""Every recipe composes; bad values fail at start-up, naming the field, before any engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.utils import instantiate

from tests.conftest import ROOT, compose

RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))


def test_there_are_recipes():
    assert {"sft_warmup", "sync_grpo"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_instantiates_cheaply(recipe):
    cfg = compose([f"recipe={recipe}"])
    # Instantiating data and module must not start an engine or load a model.
    dm = instantiate(cfg.data)
    module = instantiate(cfg.module)
    assert getattr(module, "policy", None) is None
    engine = getattr(dm, "engine", None)
    assert engine is None or not engine.started


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_header_says_how_to_run_it(recipe):
    text = (ROOT / "recipes" / f"{recipe}.yaml").read_text()
    assert text.startswith("# @package _global_")
    assert f"python train.py recipe={recipe}" in text


def test_a_recipes_top_level_keys_win_over_the_base_config():
    assert compose(["recipe=sft_warmup"]).optimized_metric == "eval/reward_mean"
    assert compose([]).optimized_metric == "eval/sampled_reward_mean"
    assert compose(["recipe=gsm8k_grpo"]).torch_threads == 8
    assert compose(["recipe=gsm8k_grpo", "torch_threads=3"]).torch_threads == 3  # command line last


def test_run_dirs_are_per_recipe():
    cfg = compose(["recipe=sft_warmup"])
    assert Path(cfg.model.path).name == "tiny-qwen-sft"


def test_run_seed_reaches_prompt_order_and_engine():
    cfg = compose(["seed=3"])
    assert cfg.data.seed == 3 and cfg.engine.seed == 3


@pytest.mark.parametrize("logger", ["csv", "tensorboard", "wandb", "mlflow"])
def test_logger_configs_compose(logger):
    cfg = compose([f"logger={logger}"])
    assert "csv" in cfg.logger  # CSV always on: metrics.csv feeds make report
    assert all("_target_" in c for c in cfg.logger.values())
