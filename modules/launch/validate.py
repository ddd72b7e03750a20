"""Rules that relate fields of different config groups, checked by train.py before anything is built.

    python train.py rollout.sampling.max_tokens=400     # ConfigError naming the field: no room for the prompt

Where the other checks live: every field's type comes from the signature of what it builds
(``schema.py``); a single field's range or choice is checked by the constructor it configures
(``check`` calls, run when train.py builds every object, before the engine or a model); files
and machine resources are ``preflight.py``'s. Each cross-field rule is a named function beside
the class it concerns; this file lists them in the order they run (``CROSS_FIELD_RULES``, and
``RULE_HOLDERS`` for the data side's classes, which ``modules/`` may not import). A rule asks a
class what it is (``issubclass``, its own rules) and never reads a ``_target_``'s name. Every
failure is a ``ConfigError`` naming the field, the value and what is allowed."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf

from modules.algo.advantages import group_advantage_needs_groups
from modules.algo.corrections import NoCorrection
from modules.algo.kl_reward import kl_reward_needs_whole_groups
from modules.callbacks.checkpointing import checkpoint_between_rollout_batches
from modules.callbacks.weight_sync import lag_needs_sync_barrier, weight_sync_lag
from modules.config.budget import check_budget
from modules.config.errors import ConfigError, check, is_count
from modules.config.external import check_optimizers, check_trainer
from modules.config.schema import builds, check_types, target_class
from modules.engine.gpus import engine_gpus_apart_from_trainer, nccl_needs_gpu_trainer
from modules.engine.types import sampling_fits_engine
from modules.policy.logits import temperature_matches_sampling
from modules.policy.ranks import ranks_divide_rollout_batch

log = logging.getLogger(__name__)
FULL_PRECISION = ("32", "32-true", "64", "64-true", 32, 64)


# Cross-field rules kept beside the class they concern (a ``cross_field_rules`` tuple on the
# class), found through the ``_target_`` of these config nodes; e.g. ``rollout.staleness``:
# data/rollout/staleness.py, recompute_needs_bypass_anchor.
RULE_HOLDERS = ("rollout.staleness", "rollout.overlong", "env")


def class_rules(
    cfg: DictConfig, holders: tuple[str, ...] = RULE_HOLDERS
) -> list[Callable[[DictConfig], None]]:
    """The cross-field rules of the classes ``cfg`` builds at ``holders``."""
    classes = [target_class(OmegaConf.select(cfg, path)) for path in holders]
    return [rule for cls in classes for rule in getattr(cls, "cross_field_rules", ())]


def _refuses_decoupled(cfg: DictConfig) -> bool:
    """Whether the staleness policy's own rule refuses ``algo.loss.anchor=decoupled`` here."""
    alt = copy.deepcopy(cfg)
    OmegaConf.update(alt, "algo.loss.anchor", "decoupled", force_add=True)
    try:
        for rule in class_rules(alt, ("rollout.staleness",)):
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


def lag_anchor_warning(cfg: DictConfig) -> str | None:
    """Why this run's loss is the one the multi-minibatch lag grid found weakest, or None: with
    several optimizer steps per rollout batch and trained samples that lag (a delayed sync, a
    sync every few batches, or a rollout without the sync barrier whose staleness bound is
    unbounded or above ``STREAMING_MEASURED_K``, partial rollout, or several epochs), the PPO clip
    against the stale behaviour policy (the bypass anchor) cost about 0.09 of held-out sampled
    reward at K = 2-8 and lr 5e-4 (a delayed sync, 3 seeds), while the decoupled anchor with a
    truncated correction lost none detectable; at lr 1e-3 bypass lost about 0.10 and the
    corrections' own loss is unsettled (docs/estimators.md, "Lag in the multi-minibatch
    regime"). Quiet where the pre-registered streaming sitting measured (streaming rollout, K of
    at most 4, one epoch, 5 seeds; partial rollout, whose groups carry tokens of several
    versions, was not measured there): there bypass was not separable from sync or from decoupled
    + ``tis`` (docs/estimators.md, "Streaming with four minibatches"). Quiet with one step per
    batch (another regime: its evidence favours the bypass anchor near the on-policy edge) and
    with a staleness policy that re-anchors at the bypass anchor itself (recompute, whose own
    rule refuses the decoupled anchor)."""
    algo, rollout, data = cfg.algo, cfg.rollout, cfg.get("data") or {}
    minibatches, epochs = algo.get("minibatches", 1), algo.get("epochs", 1)
    lag = weight_sync_lag(cfg)
    bound = rollout.get("max_staleness")
    if not (
        is_count(minibatches) and is_count(epochs) and isinstance(lag, int) and not isinstance(lag, bool)
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
        measured = rollout.get("_target_") == STREAMING_MEASURED_ROLLOUT
        if measured and is_count(bound) and bound <= STREAMING_MEASURED_K and epochs == 1:
            return None  # measured in streaming: not separable from sync or from decoupled + tis
        where = f"a rollout without the sync barrier, rollout.max_staleness={bound}, algo.epochs={epochs}"
    elif (isinstance(sync_every, int) and sync_every > 1) or data.get("sync_every_s"):
        where = "data.sync_every / data.sync_every_s: several batches per weight sync"
    else:
        return None
    return (
        f"algo.minibatches * algo.epochs = {steps} optimizer steps per rollout batch with "
        f"algo.loss.anchor=bypass under lag ({where}): on the testbed (a delayed sync, lag 2-8, "
        "lr 5e-4, 3 seeds) the bypass anchor lost ~0.09 held-out sampled reward against lag 0, "
        "while algo.loss.anchor=decoupled algo/correction=tis (or tseq_is) lost none detectable "
        "(tis -0.014 [-0.047, +0.019]); at lr 1e-3 bypass lost ~0.10 and the corrections' loss is "
        "unsettled (docs/estimators.md, 'Lag in the multi-minibatch regime'; streaming rollout at "
        f"rollout.max_staleness <= {STREAMING_MEASURED_K} with one epoch, where bypass was not "
        "separable from either, is quiet: 'Streaming with four minibatches')"
    )


# The rollout and the largest bound the streaming sitting with several minibatches measured
# (regenerate, K = 4); partial rollout was not part of it.
STREAMING_MEASURED_ROLLOUT = "data.rollout.streaming.StreamingRollout"
STREAMING_MEASURED_K = 4


def lr_positive(cfg: DictConfig) -> None:
    lr = cfg.module.get("optimizer", {}).get("lr")
    if lr is not None:
        check("module.optimizer.lr", lr, lr > 0, "a float > 0 (0 trains nothing)")


def torch_threads_positive(cfg: DictConfig) -> None:
    check("torch_threads", cfg.get("torch_threads", 1), cfg.get("torch_threads", 1) >= 1, "an int >= 1")


def data_side_rules(cfg: DictConfig) -> None:
    """The cross-field rules of the data side's classes (``RULE_HOLDERS``)."""
    for rule in class_rules(cfg):
        rule(cfg)


# The rules that relate fields of several groups, in the order they run (the first broken one
# is reported): each a named function beside the class it concerns; those of the data side
# (which modules/ may not import) are found on the classes at RULE_HOLDERS.
CROSS_FIELD_RULES: tuple[Callable[[DictConfig], None], ...] = (
    sampling_fits_engine,  # modules/engine/types.py
    temperature_matches_sampling,  # modules/policy/logits.py
    group_advantage_needs_groups,  # modules/algo/advantages.py
    lr_positive,  # here: the optimizer is torch's
    lag_needs_sync_barrier,  # modules/callbacks/weight_sync.py
    torch_threads_positive,  # here
    data_side_rules,  # data/rollout/staleness.py (recompute), shaping.py (overlong), data/envs/base.py
    nccl_needs_gpu_trainer,  # modules/engine/gpus.py
    engine_gpus_apart_from_trainer,  # modules/engine/gpus.py
    checkpoint_between_rollout_batches,  # modules/callbacks/checkpointing.py
    kl_reward_needs_whole_groups,  # modules/algo/kl_reward.py
    ranks_divide_rollout_batch,  # modules/policy/ranks.py
)


def _validate_rl(cfg: DictConfig) -> None:
    algo, engine = cfg.algo, cfg.engine
    for warning in (mismatch_warning(cfg), lag_anchor_warning(cfg)):
        if warning:
            log.warning(warning)
    from modules.policy.microbatch import check_size

    check_size(algo.get("micro_batch_size"))
    mml = engine.max_model_len  # its own range first: the rules below divide by it
    check("engine.max_model_len", mml, isinstance(mml, int) and mml >= 16, "an int >= 16")
    check_budget(cfg)  # sizes that would not fit in memory or the engine's queue
    for rule in CROSS_FIELD_RULES:
        rule(cfg)
