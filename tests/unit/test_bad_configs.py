"""At least 30 distinct bad configs, each rejected before anything heavy is built, with a
message naming the field. In-process (fast); tests/unit/test_config.py runs a few through train.py."""

from __future__ import annotations

import pytest

from modules.config.errors import ConfigError
from modules.launch.compose import build
from modules.launch.validate import validate
from tests.conftest import compose

BAD = [
    # (overrides, field named in the message)
    (["rollout.group_size=0"], "rollout.group_size"),
    (["rollout.group_size=-3"], "rollout.group_size"),
    (["rollout.prompts_per_step=0"], "rollout.prompts_per_step"),
    (["rollout.sampling.temperature=0", "module.temperature=0"], "rollout.sampling.temperature"),
    (["rollout.sampling.temperature=-1"], "rollout.sampling.temperature"),
    (["rollout.sampling.top_p=0"], "rollout.sampling.top_p"),
    (["rollout.sampling.top_p=0.9"], "rollout.sampling.top_p"),
    (["rollout.sampling.top_k=5"], "rollout.sampling.top_k"),
    (["rollout.sampling.max_tokens=0"], "rollout.sampling.max_tokens"),
    (["rollout.sampling.max_tokens=400"], "rollout.sampling.max_tokens"),  # > engine.max_model_len
    (["module.temperature=0.7"], "module.temperature"),  # trainer and engine would disagree
    (["engine.max_model_len=8"], "engine.max_model_len"),
    (["engine.max_num_seqs=0"], "engine.max_num_seqs"),
    (["engine.dtype=int4"], "engine.dtype"),
    (["engine.stall_timeout_s=0"], "engine.stall_timeout_s"),
    (["engine.gpu_ids=[]"], "engine.gpu_ids"),
    (
        ["engine=vllm_gpu", "trainer.accelerator=gpu", "trainer.devices=[0,1]", "engine.gpu_ids=[1]"],
        "engine.gpu_ids",
    ),
    (  # an int N is GPUs 0..N-1, so 2 trainer GPUs collide with the engine's GPU 1
        ["engine=vllm_gpu", "trainer.accelerator=gpu", "trainer.devices=2", "engine.gpu_ids=[1]"],
        "engine.gpu_ids",
    ),
    (["engine=vllm_gpu", "trainer.accelerator=gpu", "trainer.devices=auto"], "trainer.devices"),
    (["trainer.devices=3"], "trainer.devices"),
    (
        ["algo.minibatches=8", "callbacks.checkpoint.every_n_train_steps=20"],
        "callbacks.checkpoint.every_n_train_steps",
    ),  # 3 ranks cannot split a batch of P x G evenly
    (["trainer.devices=2", "algo.minibatches=5"], "trainer.devices"),  # 128 % (2 x 5) != 0
    (["engine.weight_transfer=bogus"], "engine.weight_transfer"),
    (["engine.weight_transfer=nccl", "trainer.accelerator=gpu"], "engine.weight_transfer"),  # no gpu_ids
    (["engine=vllm_gpu", "trainer.accelerator=cpu"], "engine.weight_transfer"),  # nccl from a CPU trainer
    (["algo.minibatches=0"], "algo.minibatches"),
    (["algo.minibatches=1000"], "algo.minibatches"),  # more minibatches than samples
    (["algo.epochs=0"], "algo.epochs"),
    (["algo.advantage.eps=0"], "algo.advantage.eps"),
    (["algo.loss.anchor=sideways"], "algo.loss.anchor"),
    (["algo.loss.aggregation=sum"], "algo.loss.aggregation"),
    (["algo.loss.aggregation=seq_mean_token_sum_norm"], "algo.loss.norm_const"),
    (["algo.loss.kl_kind=k4"], "algo.loss.kl_kind"),
    (["algo.loss.kl_coef=-1"], "algo.loss.kl_coef"),
    (["algo.loss.kl_coef=0.1", "module.ref_model_path=null"], "module.ref_model_path"),
    (["algo.objective.eps_high=-0.1"], "algo.objective.eps_high"),
    (["algo.objective.dual_clip=0.5"], "algo.objective.dual_clip"),
    (["algo/correction=tis", "algo.loss.anchor=decoupled", "algo.correction.cap=0"], "algo.correction.cap"),
    (
        ["algo/correction=mis", "algo.loss.anchor=decoupled", "algo.correction.lower=3"],
        "algo.correction.lower",
    ),
    (["algo/correction=tis"], "algo.loss.anchor"),  # a weight pi_old/mu is 1 in bypass mode
    (["algo/correction=lag", "algo.correction.gamma=0"], "algo.correction.gamma"),
    (["rollout=partial", "rollout.over_provision=0.5"], "rollout.over_provision"),
    (["rollout=streaming", "rollout.max_inflight=0"], "rollout.max_inflight"),
    (["rollout=streaming", "rollout.max_staleness=-1"], "rollout.max_staleness"),
    (["rollout=streaming", "rollout.buffer_capacity=4"], "rollout.buffer_capacity"),  # < prompts_per_step
    (["rollout=streaming", "rollout.inflight=pause"], "rollout.inflight"),
    (["rollout=streaming", "rollout.max_age_s=0"], "rollout.max_age_s"),
    (
        ["rollout=streaming", "rollout/staleness=downweight", "rollout.staleness.gamma=2"],
        "rollout.staleness.gamma",
    ),
    (
        ["rollout=streaming", "rollout/staleness=admit", "data.sync_every_s=5"],
        "data.sync_every_s",
    ),
    (
        ["rollout=streaming", "rollout/staleness=throttle", "data.sync_every_s=5"],
        "data.sync_every_s",
    ),
    (["data.sync_every=0"], "data.sync_every"),
    (["data.train_size=0"], "data.train_size"),
    (["data.eval_size=-1"], "data.eval_size"),
    (["data.reward_errors=ignore"], "data.reward_errors"),
    (["data.reward_timeout_s=0"], "data.reward_timeout_s"),
    (["task.level_weights=[1,0]"], "task.level_weights"),
    (["task.max_divisor=12"], "task.max_divisor"),
    (["task.credit=partial"], "task.credit"),
    (["task.min_divisor=2", "task.max_divisor=1"], "task.max_divisor"),
    (["task.min_divisor=4", "task.max_divisor=5"], "task.min_divisor"),  # 37 steps would pass 99
    (["task.demo_slip=1.5"], "task.demo_slip"),
    (["module.max_consecutive_skips=0"], "module.max_consecutive_skips"),
    (["callbacks.eval.every_n_versions=-2"], "callbacks.eval.every_n_versions"),
    (["trainer.max_steps=0"], "trainer.max_steps"),
]


def check_config(overrides: list[str]) -> None:
    cfg = compose(overrides)
    validate(cfg)
    build(cfg.data)
    build(cfg.module)
    for c in (cfg.get("callbacks") or {}).values():  # as train.py builds them, before fit
        build(c)


def test_there_are_at_least_30_distinct_bad_configs():
    assert len({tuple(o) for o, _ in BAD}) >= 30


@pytest.mark.parametrize(("overrides", "field"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_is_rejected_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        check_config(overrides)
    assert field in str(info.value), str(info.value)
    assert "must be" in str(info.value)


def test_default_and_recipe_configs_pass():
    for recipe in ("sync_grpo", "partial_grpo", "async_grpo", "sft_warmup"):
        check_config([f"recipe={recipe}"])
