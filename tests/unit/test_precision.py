"""One precision policy: float32 on CPU, bf16 engine + bf16-mixed trainer on GPUs, and a start-up
warning whenever that engine-trainer mismatch is left uncorrected."""

from __future__ import annotations

import logging

import pytest

from modules.callbacks.weight_sync import VERIFY_TOLERANCE, verify_tolerance
from modules.launch.validate import mismatch_warning, validate
from tests.conftest import compose

GPU_RECIPES = ["gsm8k_grpo", "math_grpo"]


def test_cpu_default_is_float32_on_both_sides_and_quiet():
    cfg = compose([])
    assert cfg.engine.dtype == "float32" and cfg.trainer.precision == "32-true"
    assert mismatch_warning(cfg) is None


def test_gpu_trainer_and_engine_default_to_bf16_together():
    cfg = compose(["trainer=gpu", "engine=vllm_gpu"])
    assert cfg.engine.dtype == "bfloat16" and cfg.trainer.precision == "bf16-mixed"
    assert (
        verify_tolerance(cfg.callbacks.weight_sync.get("tolerance"), cfg.engine.dtype)
        == VERIFY_TOLERANCE["bfloat16"]
    )


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_recipes_correct_the_mismatch_by_default(recipe):
    cfg = compose([f"recipe={recipe}"])
    assert cfg.engine.dtype == "bfloat16" and cfg.trainer.precision == "bf16-mixed"
    assert cfg.algo.loss.anchor == "decoupled"
    assert not cfg.algo.correction._target_.endswith("NoCorrection")
    assert mismatch_warning(cfg) is None


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["engine.dtype=bfloat16"], ["engine.dtype=bfloat16"]),
        (["trainer.precision=bf16-mixed"], ["trainer.precision=bf16-mixed"]),
        (["trainer=gpu", "engine=vllm_gpu"], ["engine.dtype=bfloat16", "trainer.precision=bf16-mixed"]),
        # a correction with the bypass anchor sees pi_old = mu: it corrects nothing
        (["engine.dtype=bfloat16", "algo/correction=tis"], ["engine.dtype=bfloat16", "anchor=bypass"]),
        (["recipe=gsm8k_grpo", "algo/correction=none"], ["engine.dtype=bfloat16", "no correction"]),
    ],
)
def test_uncorrected_mismatch_warns_at_start_up_naming_the_fields(overrides, names, caplog):
    cfg = compose(overrides)
    message = mismatch_warning(cfg)
    assert message is not None and all(n in message for n in names), message
    assert "algo.loss.anchor=decoupled" in message  # and says what fixes it
    with caplog.at_level(logging.WARNING, logger="modules.launch.validate"):
        validate(cfg)
    assert any("engine and trainer logprobs differ" in r.getMessage() for r in caplog.records)


def test_corrected_mismatch_is_quiet():
    cfg = compose(["engine.dtype=bfloat16", "algo.loss.anchor=decoupled", "algo/correction=icepop"])
    assert mismatch_warning(cfg) is None
