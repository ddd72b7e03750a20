"""GPU placement on one node: which GPUs train, which generate, and what the engine sees.

    python train.py recipe=async_grpo trainer=gpu engine=vllm_gpu trainer.devices=4   # engine: 4 spare
    python train.py recipe=async_grpo trainer=gpu engine=vllm_gpu trainer.devices=6 engine.num_gpus=2

Rules (``place_gpus``, run by ``train.py`` before anything is built):

* GPU indexes are *relative to what this process may see*: with an inherited
  ``CUDA_VISIBLE_DEVICES=4,5,6,7`` (a SLURM or container allocation) index 0 is physical GPU 4,
  as Lightning counts them.
* ``trainer.devices``: a count N takes indexes 0..N-1, a list takes those; ``-1`` / ``auto``
  would take every GPU and leave none to generate, so it is refused with a split to type.
* ``engine.gpu_ids: auto`` (``conf/engine/vllm_gpu.yaml``) gives the engine the first
  ``engine.num_gpus`` indexes the trainer does not use; a list names them (disjoint from the
  trainer's). When the node has too few GPUs the error names both fields and suggests a split
  whose trainer count divides the rollout batch (DDP shards it equally).
* The engine's worker processes get ``CUDA_VISIBLE_DEVICES`` = the *inherited* names of its
  indexes, set only while the engine starts and restored after (``engine_visible_devices``), so
  the trainer and the next job of a multirun keep the set they inherited.

Tested with faked device counts and inherited values (``tests/unit/test_gpu_placement.py``); not run
on a GPU here (no GPU in CI).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from modules.config.errors import ConfigError, check
from modules.config.schema import target_class

ENV = "CUDA_VISIBLE_DEVICES"


def visible_gpus(env: Mapping[str, str], device_count: int) -> list[str]:
    """Names of the GPUs this process may use, in Lightning's index order: the inherited
    ``CUDA_VISIBLE_DEVICES`` entries (ids or UUIDs), else 0..count-1."""
    inherited = env.get(ENV)
    if inherited is None:
        return [str(i) for i in range(device_count)]
    names = [x.strip() for x in inherited.split(",") if x.strip()]
    return names[:device_count]


def wants_gpus(accelerator: object, device_count: int) -> bool:
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and device_count > 0)


@dataclass(frozen=True)
class Placement:
    trainer: list[int]  # indexes (relative to the visible set) the trainer's ranks use
    engine: list[int]  # indexes the engine uses
    engine_devices: str  # CUDA_VISIBLE_DEVICES for the engine's workers (inherited names)


def suggest_split(n_gpus: int, fits: Callable[[int], bool], engine_min: int = 1) -> str:
    """The largest trainer count that leaves >= engine_min GPUs and ``fits`` (splits the batch)."""
    for t in range(n_gpus - engine_min, 0, -1):
        if fits(t):
            return f"trainer.devices={t} engine.num_gpus={n_gpus - t}"
    return f"a node with more than {engine_min} GPU(s)"


def batch_splitter(batch: int, minibatches: int = 1, prompts: int | None = None) -> Callable[[int], bool]:
    """Whether t DDP ranks split the rollout batch as ``modules/launch/validate.py`` requires: equal
    shards of every minibatch, and (``prompts`` given: a KL reward) whole groups per rank."""
    return lambda t: batch % (t * minibatches) == 0 and (prompts is None or prompts % t == 0)


def plan(
    devices: object,
    gpu_ids: object,
    num_gpus: object,
    visible: list[str],
    fits: Callable[[int], bool],
    batch: int | str = "the rollout batch",
) -> Placement:
    """Resolve trainer and engine GPU indexes, or raise ConfigError naming the field. ``fits(t)``:
    whether t trainer ranks split the batch (``batch_splitter``)."""
    n = len(visible)
    check("engine.num_gpus", num_gpus, isinstance(num_gpus, int) and num_gpus >= 1, "an int >= 1")
    assert isinstance(num_gpus, int)
    hint = suggest_split(n, fits, num_gpus if gpu_ids == "auto" else 1)
    if devices in (-1, "-1", "auto"):
        raise ConfigError(
            f"trainer.devices={devices} would take all {n} GPUs and leave none to the engine; "
            f"give a count or list, e.g. {hint}"
        )
    if isinstance(devices, int):
        check("trainer.devices", devices, devices >= 1, "an int >= 1, or a list of GPU indexes")
        trainer = list(range(devices))
    else:
        trainer = [int(i) for i in devices]  # type: ignore[union-attr]
    bad = [i for i in trainer if not 0 <= i < n]
    check(
        "trainer.devices",
        devices,
        not bad and len(set(trainer)) == len(trainer),
        f"distinct GPU indexes below {n} (this process sees {n} GPU(s): {','.join(visible) or 'none'})",
    )
    if gpu_ids == "auto":
        spare = [i for i in range(n) if i not in trainer]
        if len(spare) < num_gpus:
            raise ConfigError(
                f"trainer.devices={devices} and engine.num_gpus={num_gpus} need "
                f"{len(trainer) + num_gpus} GPUs; this process sees {n}. Try {hint} "
                f"(the trainer count must split {batch})"
            )
        engine = spare[:num_gpus]
    else:
        engine = [int(i) for i in gpu_ids]  # type: ignore[union-attr]
        check(
            "engine.gpu_ids",
            list(engine),
            bool(engine) and all(0 <= i < n for i in engine) and not set(engine) & set(trainer),
            f"'auto' or GPU indexes below {n} disjoint from the trainer's {trainer}, e.g. {hint}",
        )
    check(
        "trainer.devices",
        devices,
        fits(len(trainer)),
        f"a GPU count that splits {batch} into equal shards (DDP), e.g. {hint}",
    )
    return Placement(trainer, engine, ",".join(visible[i] for i in engine))


def place_gpus(
    cfg, device_count: int | None = None, env: Mapping[str, str] | None = None
) -> Placement | None:
    """Write the resolved placement into ``cfg`` (trainer.devices, engine.gpu_ids as index
    lists, engine.visible_devices) when the run trains on GPUs; None on CPU."""
    from omegaconf import OmegaConf, open_dict

    if device_count is None:
        import torch

        device_count = torch.cuda.device_count()
    env = os.environ if env is None else env
    accelerator = cfg.trainer.get("accelerator")
    engine = cfg.engine
    if not wants_gpus(accelerator, device_count):
        if device_count > 0 and env.get("LOCAL_RANK", "0") == "0":  # GPUs are an explicit
            # choice, but say so once: a CPU run on a GPU node is rarely what was meant
            rl = getattr(target_class(cfg.get("module")), "needs_engine", False)
            logging.getLogger(__name__).warning(
                "this node has %d CUDA GPU(s) and the trainer runs on CPU (trainer.accelerator=%s); "
                "for GPUs: %s (docs/gpu.md, 'On a GPU node')",
                device_count,
                accelerator,
                "trainer=gpu engine=vllm_gpu" if rl else "trainer=gpu",
            )
        check(
            "engine.gpu_ids",
            engine.get("gpu_ids"),
            engine.get("gpu_ids") != "auto",
            "null (or a list) with a CPU trainer: auto takes the GPUs a GPU trainer leaves",
        )
        return None
    check("trainer.accelerator", accelerator, device_count > 0, "cpu on a machine without a CUDA GPU")
    if not getattr(target_class(cfg.get("module")), "needs_engine", False):
        return None  # no engine to place (recipe=sft_warmup): the trainer takes trainer.devices
    fits, batch = _splitter(cfg)
    devices = cfg.trainer.get("devices")
    devices = OmegaConf.to_container(devices) if OmegaConf.is_list(devices) else devices
    gpu_ids = engine.get("gpu_ids")
    gpu_ids = OmegaConf.to_container(gpu_ids) if OmegaConf.is_list(gpu_ids) else gpu_ids
    if gpu_ids is None:
        raise ConfigError(
            "engine.gpu_ids=null runs the engine on CPU beside a GPU trainer; use engine=vllm_gpu "
            "(engine.gpu_ids=auto) or name the engine's GPUs"
        )
    num_gpus = engine.get("num_gpus", 1)
    placement = plan(devices, gpu_ids, num_gpus, visible_gpus(env, device_count), fits, batch)
    with open_dict(cfg):
        cfg.trainer.devices = placement.trainer
        cfg.engine.gpu_ids = placement.engine
        cfg.engine.visible_devices = placement.engine_devices
    return placement


def engine_devices(
    gpu_ids: list[int] | None, placed: str | None, env: Mapping[str, str] | None = None
) -> str | None:
    """The engine's CUDA_VISIBLE_DEVICES: the placement's, else its indexes mapped through the
    inherited set (None on CPU)."""
    if placed is not None or gpu_ids is None:
        return placed
    names = visible_gpus(os.environ if env is None else env, 1 << 16)
    if any(not 0 <= i < len(names) for i in gpu_ids):
        raise ConfigError(f"engine.gpu_ids={gpu_ids}: indexes beyond the visible GPUs {names}")
    return ",".join(names[i] for i in gpu_ids)


def _splitter(cfg) -> tuple[Callable[[int], bool], str]:
    """``batch_splitter`` from the config (any rank count fits while a batch field is invalid:
    ``modules/launch/validate.py`` names that field next)."""
    rollout, algo = cfg.rollout, cfg.algo
    fields = (rollout.get("prompts_per_step"), rollout.get("group_size"), algo.get("minibatches", 1))
    if not all(isinstance(v, int) and v >= 1 for v in fields):
        return (lambda t: True), "the rollout batch"
    prompts, group, minibatches = fields
    kl = bool((algo.get("kl_reward") or {}).get("coef"))
    desc = f"the rollout batch ({prompts} x {group}" + (
        f", {minibatches} minibatches" if minibatches > 1 else ""
    )
    desc += ", whole groups per rank for the KL reward)" if kl else ")"
    return batch_splitter(prompts * group, minibatches, prompts if kl else None), desc


@contextlib.contextmanager
def engine_visible_devices(value: str | None) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES=value`` while the engine's processes are spawned; the inherited
    value (or its absence) is restored after, whatever happens."""
    if value is None:
        yield
        return
    saved = os.environ.get(ENV)
    os.environ[ENV] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved


def nccl_needs_gpu_trainer(cfg: Any) -> None:
    """Cross-field rule: the NCCL weight transfer broadcasts from the trainer's GPU."""
    if cfg.engine.get("weight_transfer") == "nccl":
        check(
            "engine.weight_transfer",
            "nccl",
            cfg.trainer.get("accelerator") != "cpu",
            "shm with trainer.accelerator=cpu (nccl broadcasts from the trainer's GPU)",
        )


def engine_gpus_apart_from_trainer(cfg: Any) -> None:
    """Cross-field rule: ``engine.gpu_ids`` and ``trainer.devices`` name disjoint GPUs. An int N
    means GPUs 0..N-1 to Lightning; -1 / "auto" means all of them. Against the GPUs this machine
    has, ``place_gpus`` checks again when train.py places them."""
    from omegaconf import OmegaConf

    from modules.config.errors import is_count

    gpu_ids, devices = cfg.engine.get("gpu_ids"), cfg.trainer.get("devices")
    if gpu_ids is None or cfg.trainer.get("accelerator") not in ("gpu", "cuda"):
        return
    trainer_gpus = (
        set(devices) if OmegaConf.is_list(devices) else set(range(devices)) if is_count(devices) else None
    )
    check(
        "trainer.devices",
        devices,
        trainer_gpus is not None,
        f"a GPU count or list when engine.gpu_ids={gpu_ids} is set ('auto' / -1 would take the engine's GPUs too)",
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
