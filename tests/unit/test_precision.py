"""One precision policy: float32 on CPU, bf16 engine + bf16-mixed trainer on GPUs, and a start-up
warning whenever that engine-trainer mismatch is left uncorrected."""

from __future__ import annotations

import logging

import pytest

from modules.callbacks.weight_sync import VERIFY_TOLERANCE, verify_tolerance
from modules.launch.validate import lag_anchor_warning, mismatch_warning, validate
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


@pytest.mark.parametrize(
    "overrides, where",
    [
        (["rollout=streaming", "algo.minibatches=4", "rollout.max_staleness=8"], "rollout.max_staleness=8"),
        (["recipe=partial_grpo", "algo.epochs=2"], "without the sync barrier"),  # unbounded, 2 epochs
        # partial rollout at K = 2: the streaming sitting did not measure it
        (["rollout=partial", "algo.minibatches=4", "rollout.max_staleness=2"], "rollout.max_staleness=2"),
        (["rollout=streaming", "algo.epochs=2"], "algo.epochs=2"),  # K = 2, but two epochs
        (["callbacks.weight_sync.lag=2", "algo.minibatches=4"], "callbacks.weight_sync.lag=2"),
        (["data.sync_every=2", "algo.minibatches=4"], "data.sync_every"),  # a lag by another name
    ],
)
def test_several_steps_per_batch_under_lag_with_the_bypass_anchor_warn_at_start_up(overrides, where, caplog):
    """The multi-minibatch lag grid's weakest loss (docs/estimators.md) is named at start-up,
    with what lost no detectable reward against lag 0 there, wherever the lag reaches past
    what the streaming sitting measured."""
    cfg = compose(overrides)
    message = lag_anchor_warning(cfg)
    assert message is not None and where in message and "algo.loss.anchor=decoupled" in message
    with caplog.at_level(logging.WARNING, logger="modules.launch.validate"):
        validate(cfg)
    assert any("optimizer steps per rollout batch" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "overrides",
    [
        ["algo.minibatches=4"],  # sync, no lag
        ["rollout=streaming"],  # one step per batch: the other regime
        ["callbacks.weight_sync.lag=2"],
        # streaming within the measured range (K <= 4, one epoch): bypass not separable there
        ["rollout=streaming", "algo.minibatches=4"],
        ["rollout=streaming", "algo.minibatches=4", "rollout.max_staleness=4"],
        ["rollout=streaming", "algo.minibatches=4", "algo.loss.anchor=decoupled", "algo/correction=tseq_is"],
        ["recipe=async_grpo", "algo.minibatches=4"],  # bypass at K = 4 in streaming: measured, quiet
        ["recipe=gsm8k_grpo"],
        ["recipe=math_grpo"],
        ["rollout=streaming", "algo.minibatches=four"],  # a bad value: its own check reports it
        ["rollout=streaming", "algo.minibatches=4", "rollout.max_staleness=0"],  # on-policy streaming
        # recompute re-anchors stale groups itself and needs the bypass anchor (validate refuses decoupled)
        ["rollout=streaming", "algo.minibatches=4", "rollout/staleness=recompute"],
    ],
)
def test_the_lag_anchor_warning_is_quiet_otherwise(overrides):
    assert lag_anchor_warning(compose(overrides)) is None


def test_the_lag_anchor_warning_reads_a_config_without_a_weight_sync_group():
    message = lag_anchor_warning(
        compose(
            [
                "rollout=streaming",
                "algo.minibatches=4",
                "rollout.max_staleness=8",
                "callbacks.weight_sync=null",
            ]
        )
    )
    assert message is not None and "without the sync barrier" in message
