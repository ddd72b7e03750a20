"""Train a policy with asyncrl: compose the config, build the parts, fit, return the metric.

    python train.py                          # default recipe (sync GRPO on the remainder task)
    python train.py recipe=sft_warmup        # supervised warm start the RL recipes begin from
    python train.py -m rollout.group_size=4,8 seed=0,1    # a Hydra sweep

Every object comes from a ``_target_`` in ``conf/``; a recipe in ``recipes/`` only overrides.
"""

from __future__ import annotations

import logging
import signal

import hydra
import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from modules.config_errors import ConfigError
from modules.validate import validate

log = logging.getLogger(__name__)


def build(cfg: DictConfig, **kwargs: object) -> object:
    """``instantiate`` that surfaces our ConfigError (naming the field) instead of Hydra's wrapper."""
    try:
        return instantiate(cfg, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from None
        raise


def train(cfg: DictConfig) -> float | None:
    validate(cfg)  # cross-field rules; single-field ones run in the constructors below
    L.seed_everything(cfg.seed, workers=True)
    torch.set_num_threads(cfg.torch_threads)
    # Everything below is cheap to construct and validates its arguments; the engine and the
    # model are only built inside fit(), so a bad value fails here, within seconds.
    datamodule = build(cfg.data)
    module = build(cfg.module)
    callbacks = [build(c) for c in (cfg.get("callbacks") or {}).values()]
    loggers = [build(c) for c in (cfg.get("logger") or {}).values()]
    trainer: L.Trainer = build(cfg.trainer, callbacks=callbacks, logger=loggers)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    except SystemExit:  # Lightning turns Ctrl-C / SIGTERM into an exit; say which (130 / 143)
        code = getattr(trainer, "asyncrl_exit_code", 1)
        # DDP: the other ranks stop cleanly with rank 0, which reports the code (a nonzero
        # exit of theirs would make Lightning's observer SIGKILL rank 0 mid-shutdown)
        raise SystemExit(code if trainer.global_rank == 0 else 0) from None
    except BaseException:
        stop_other_ranks(trainer)  # DDP: they would wait in a collective until its timeout
        raise
    finally:
        teardown = getattr(datamodule, "shutdown", None)
        if teardown is not None:
            teardown()  # engine down even if fit raised; a no-op when already down
    metric = trainer.callback_metrics.get(cfg.optimized_metric)
    log.info("%s = %s; outputs in %s", cfg.optimized_metric, metric, cfg.paths.output_dir)
    release_freed_memory()  # a multirun's next job starts from a trimmed heap
    log.info("process after job: %s", process_footprint())  # multirun leak check
    return None if metric is None else float(metric)


def stop_other_ranks(trainer: L.Trainer) -> None:
    """On rank 0's failure, kill the DDP ranks it launched (no-op with one device)."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    if trainer.global_rank == 0 and isinstance(launcher, _SubprocessScriptLauncher):
        launcher.kill(signal.SIGKILL)


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``), so
    RSS after a job measures what is still referenced, not allocator slack."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc (e.g. macOS): nothing to trim
        pass


def process_footprint() -> str:
    import threading

    import psutil

    me = psutil.Process()
    children = 0
    for child in me.children(recursive=True):
        try:
            children += "resource_tracker" not in " ".join(child.cmdline())
        except psutil.Error:
            continue
    return f"rss_mb={me.memory_info().rss / 2**20:.0f} threads={threading.active_count()} children={children}"


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return train(cfg)


if __name__ == "__main__":
    main()
