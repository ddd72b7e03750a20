"""GPU placement rules with faked device counts and inherited CUDA_VISIBLE_DEVICES (no GPU here)."""

from __future__ import annotations

import os

import pytest

from modules.config.errors import ConfigError
from modules.engine.gpus import (
    batch_splitter,
    engine_devices,
    engine_visible_devices,
    place_gpus,
    plan,
    suggest_split,
    visible_gpus,
)
from tests.conftest import compose

GPU = ["trainer=gpu", "engine=vllm_gpu"]


def test_visible_gpus_follow_the_inherited_set():
    assert visible_gpus({}, 4) == ["0", "1", "2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5"}, 2) == ["4", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a1, GPU-b2"}, 2) == ["GPU-a1", "GPU-b2"]


def test_the_engine_takes_the_gpus_the_trainer_leaves():
    p = plan(4, "auto", 4, [str(i) for i in range(8)], batch_splitter(128))
    assert p.trainer == [0, 1, 2, 3] and p.engine == [4, 5, 6, 7] and p.engine_devices == "4,5,6,7"
    p = plan([0, 2], "auto", 1, [str(i) for i in range(4)], batch_splitter(128))
    assert p.trainer == [0, 2] and p.engine == [1]


def test_indexes_are_relative_to_an_inherited_allocation():
    """SLURM gave this job physical GPUs 4 and 5: index 1 is physical 5, not 1."""
    p = plan(1, "auto", 1, ["4", "5"], batch_splitter(128))
    assert p.trainer == [0] and p.engine == [1] and p.engine_devices == "5"
    p = plan([1], [0], 1, ["4", "5"], batch_splitter(128))
    assert p.engine_devices == "4"


def test_a_full_node_is_refused_with_a_split_that_divides_the_batch():
    with pytest.raises(ConfigError) as info:
        plan(8, "auto", 1, [str(i) for i in range(8)], batch_splitter(128))
    msg = str(info.value)
    assert "trainer.devices=8" in msg and "engine.num_gpus=1" in msg
    assert "trainer.devices=4 engine.num_gpus=4" in msg  # 7 does not divide 128; 4 does
    assert suggest_split(8, batch_splitter(96), 1) == "trainer.devices=6 engine.num_gpus=2"
    # 32 minibatches of 96: 96 % (t x 32) == 0 needs t in {1, 3}
    assert suggest_split(8, batch_splitter(96, minibatches=32), 1) == "trainer.devices=3 engine.num_gpus=5"
    # a KL reward needs whole groups per rank: 12 prompts, t must divide 12 too
    assert suggest_split(9, batch_splitter(96, prompts=12), 1) == "trainer.devices=6 engine.num_gpus=3"
    assert suggest_split(1, batch_splitter(128), 1).startswith("a node with more than")


def test_a_split_that_fits_the_node_but_not_the_batch_is_refused_with_one_that_does():
    with pytest.raises(ConfigError) as info:
        plan(7, "auto", 1, [str(i) for i in range(8)], batch_splitter(128), "the rollout batch (16 x 8)")
    assert "trainer.devices" in str(info.value) and "trainer.devices=4 engine.num_gpus=4" in str(info.value)


@pytest.mark.parametrize(
    "devices,gpu_ids,field",
    [
        (-1, "auto", "trainer.devices"),
        ("auto", "auto", "trainer.devices"),
        ([0, 9], "auto", "trainer.devices"),
        ([0, 0], "auto", "trainer.devices"),
        ([0, 1], [1], "engine.gpu_ids"),
        ([0], [5], "engine.gpu_ids"),
    ],
)
def test_bad_placements_name_the_field(devices, gpu_ids, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        plan(devices, gpu_ids, 1, ["0", "1", "2", "3"], batch_splitter(128))


def test_place_gpus_writes_the_resolved_config():
    cfg = compose([*GPU, "recipe=async_grpo", "trainer.devices=2", "engine.num_gpus=2"])
    p = place_gpus(cfg, device_count=4, env={"CUDA_VISIBLE_DEVICES": "2,3,6,7"})
    assert list(cfg.trainer.devices) == [0, 1] and list(cfg.engine.gpu_ids) == [2, 3]
    assert cfg.engine.visible_devices == "6,7" == p.engine_devices


def test_place_gpus_on_cpu_does_nothing_and_a_gpu_request_without_gpus_fails():
    cfg = compose([])
    assert place_gpus(cfg, device_count=0, env={}) is None
    assert cfg.trainer.devices == 1
    with pytest.raises(ConfigError, match="trainer.accelerator"):
        place_gpus(compose(GPU), device_count=0, env={})
    with pytest.raises(ConfigError, match="trainer.devices=1 and engine.num_gpus=1"):
        place_gpus(compose(GPU), device_count=1, env={})  # one GPU: nothing left to generate
    cfg = compose([*GPU, "trainer.accelerator=auto"])
    assert place_gpus(cfg, device_count=2, env={}).engine == [1]  # auto with GPUs: GPUs
    with pytest.raises(ConfigError, match="engine.gpu_ids"):
        place_gpus(compose(["trainer=gpu"]), device_count=2, env={})  # CPU engine beside GPU trainer
    with pytest.raises(ConfigError, match="engine.gpu_ids"):  # auto with a CPU trainer: nothing to leave
        place_gpus(compose(["engine=vllm_gpu", "trainer.accelerator=cpu"]), device_count=2, env={})
    with pytest.raises(ConfigError, match="engine.num_gpus"):
        place_gpus(compose([*GPU, "engine.num_gpus=0"]), device_count=2, env={})


def test_the_engine_sees_its_gpus_only_while_it_starts(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert engine_devices([2], None) == "6"  # mapped through the inherited set
    assert engine_devices([2], "1") == "1" and engine_devices(None, None) is None
    with pytest.raises(ConfigError, match="engine.gpu_ids"):
        engine_devices([3], None)
    with engine_visible_devices("6"):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError), engine_visible_devices("1"):
        raise RuntimeError("engine start failed")
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # absent before: absent after


def test_gpu_recipes_place_explicitly():
    for recipe in ("gsm8k_grpo", "math_grpo"):
        cfg = compose([f"recipe={recipe}"])
        p = place_gpus(cfg, device_count=2, env={})
        assert p.trainer == [0] and p.engine == [1]


def test_the_default_cpu_run_on_a_gpu_node_says_how_to_use_the_gpus(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="modules.engine.gpus"):
        assert place_gpus(compose(["recipe=async_grpo", "trainer.devices=8"]), device_count=8, env={}) is None
    assert any("trainer=gpu engine=vllm_gpu" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="modules.engine.gpus"):
        place_gpus(compose([]), device_count=0, env={})  # a CPU machine: nothing to say
    assert not caplog.records


def test_sft_on_gpus_places_no_engine():
    cfg = compose(["recipe=sft_warmup", "trainer=gpu", "trainer.devices=8"])
    assert place_gpus(cfg, device_count=8, env={}) is None and cfg.trainer.devices == 8
