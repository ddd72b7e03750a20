"""Adversarial start-up input: wrong types, settings that make the estimator degenerate,
paths that do not exist and resources this machine lacks are each rejected before any engine
or model is built, naming the field."""

from __future__ import annotations

import os

import pytest

from modules.config.errors import ConfigError
from modules.launch.compose import build
from modules.launch.preflight import check_environment
from modules.launch.validate import validate
from tests.conftest import compose


def rejected(overrides: list[str]) -> str:
    cfg = compose(overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
        build(cfg.data)
        build(cfg.module)
        for c in (cfg.get("callbacks") or {}).values():  # as train.py builds them, before fit
            build(c)
    return str(info.value)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("rollout.group_size=2.5", "rollout.group_size"),
        ("rollout.prompts_per_step=8.0", "rollout.prompts_per_step"),
        ("rollout.sampling.max_tokens=64.5", "rollout.sampling.max_tokens"),
        ("algo.minibatches=2.0", "algo.minibatches"),
        ("data.eval_size=1.5", "data.eval_size"),
        ("engine.max_num_seqs=true", "engine.max_num_seqs"),
        ("trainer.max_steps=ten", "trainer.max_steps"),
        ("rollout.sampling.temperature=hot", "rollout.sampling.temperature"),
        ("module.optimizer.lr=fast", "module.optimizer.lr"),
        ("torch_threads=1.5", "torch_threads"),
    ],
)
def test_wrong_types_are_rejected(override, field):
    msg = rejected([override])
    assert field in msg and "must be" in msg


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["rollout.group_size=1"], "rollout.group_size"),  # every group advantage would be 0
        (["algo.objective.eps_low=1.0"], "algo.objective.eps_low"),  # lower clip bound 0
        (["module.optimizer.lr=0"], "module.optimizer.lr"),
        (["callbacks.weight_sync.tolerance=0"], "callbacks.weight_sync.tolerance"),
        (["torch_threads=0"], "torch_threads"),
    ],
)
def test_degenerate_estimator_settings_are_rejected(overrides, field):
    assert field in rejected(overrides)


def test_single_responses_are_fine_with_a_running_baseline():
    cfg = compose(["rollout=streaming", "rollout.group_size=1", "algo/advantage=running"])
    validate(cfg)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["model.path=/nonexistent/model"], "model.path"),  # as typed (module.model_path reads it)
        (["module.ref_model_path=/nonexistent/ref", "algo.loss.kl_coef=0.1"], "module.ref_model_path"),
        (["ckpt_path=/nonexistent/last.ckpt"], "ckpt_path"),
        (["engine.cpu_cores=4096"], "engine.cpu_cores"),
        (["engine.cpu_cores=a-b"], "engine.cpu_cores"),
        (["engine.cpu_kvcache_gb=100000"], "engine.cpu_kvcache_gb"),
        (["trainer.accelerator=gpu"], "trainer.accelerator"),
    ],
)
def test_missing_files_and_resources_are_rejected(models, monkeypatch, overrides, field):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # the same answer on a GPU machine
    base = [] if field == "module.model_path" else [f"model.path={models['tied']}"]
    cfg = compose(base + overrides)
    with pytest.raises(ConfigError) as info:
        check_environment(cfg)
    assert field in str(info.value)


def test_engine_gpus_beyond_the_machine_are_rejected(models, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    ok = ["engine=vllm_gpu", "trainer.accelerator=gpu", "trainer.devices=[0]", "engine.max_model_len=320"]
    ok.append(f"model.path={models['tied']}")
    check_environment(compose([*ok, "engine.gpu_ids=[1]"]))
    with pytest.raises(ConfigError, match="engine.gpu_ids"):
        check_environment(compose([*ok, "engine.gpu_ids=[2]"]))


def test_every_core_for_the_engine_leaves_the_trainer_none(models):
    cores = sorted(os.sched_getaffinity(0))
    spec = ",".join(map(str, cores))
    with pytest.raises(ConfigError, match="engine.cpu_cores"):
        check_environment(compose([f"model.path={models['tied']}", f"engine.cpu_cores='{spec}'"]))
    check_environment(
        compose([f"model.path={models['tied']}", f"engine.cpu_cores='{spec}'", "engine.pin_trainer=false"])
    )


def test_trainer_threads_must_fit_beside_a_cpu_engine(models):
    """Pinned, the trainer has the cores the engine leaves; unpinned and overlapping (streaming),
    those too; unpinned under sync's barrier, every core (the engine idles while it steps)."""
    usable = len(os.sched_getaffinity(0))
    base = [f"model.path={models['tied']}", "engine.cpu_cores='0'"]
    for extra in ([], ["engine.pin_trainer=false", "rollout=streaming"]):
        check_environment(compose([*base, *extra, f"torch_threads={usable - 1}"]))
        if usable > 1:
            with pytest.raises(
                ConfigError, match=rf"torch_threads={usable}: must be an int in \[1, {usable - 1}\]"
            ):
                check_environment(compose([*base, *extra, f"torch_threads={usable}"]))
    check_environment(compose([*base, "engine.pin_trainer=false", "rollout=sync", f"torch_threads={usable}"]))


def test_a_sane_environment_passes(models):
    check_environment(compose([f"model.path={models['tied']}"]))


def test_context_beyond_the_models_positions_is_rejected(models):
    cfg = compose([f"model.path={models['tied']}", "engine.max_model_len=4096"])  # the model has 512
    with pytest.raises(ConfigError, match="engine.max_model_len"):
        check_environment(cfg)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("+data.eval_max_tokens=1000", "data.eval_max_tokens"),
        ("+engine.gpu_memory_utilization=1.5", "engine.gpu_memory_utilization"),
    ],
)
def test_more_out_of_range_values_are_rejected(override, field):
    assert field in rejected([override])
