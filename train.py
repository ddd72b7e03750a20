"""Train a policy with asyncrl: compose the config, build the parts, fit, return the metric.

    python train.py recipe=async_grpo                     # recipes/*.yaml; default: sync_grpo
    python train.py -m rollout.group_size=4,8 seed=0,1    # a Hydra sweep

Every object comes from a ``_target_`` in ``conf/``; exit codes, DDP stop and shutdown are in
``modules/launch/guard.py``. The training stack is imported inside ``train``: the spawned engine
core and reward workers re-import this file (Lightning alone is 5 s of imports they never use).
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from modules.engine.gpus import place_gpus
from modules.launch.cli import launch, startup
from modules.launch.compose import build  # also registers the resolvers conf/ uses
from modules.launch.multirun import this_job_for_ddp_children


def train(cfg: DictConfig) -> float | None:
    import lightning as L
    import torch

    from modules.launch.guard import guarded_fit
    from modules.launch.preflight import check_environment
    from modules.launch.validate import validate

    with startup():  # a bad value here exits 2 with one message naming it (modules/launch/cli.py)
        place_gpus(cfg)  # on GPUs: which train, which generate (engine.gpu_ids: auto), or a split
        validate(cfg)  # types and cross-field rules; single-field ones run in the constructors below
        L.seed_everything(cfg.seed, workers=True)
        torch.set_num_threads(cfg.torch_threads)
        # cheap to construct, each validates its arguments; engine and model are built in fit()
        datamodule = build(cfg.data)
        module = build(cfg.module)
        callbacks = [build(c) for c in (cfg.get("callbacks") or {}).values()]
        loggers = [build(c) for c in (cfg.get("logger") or {}).values()]
        check_environment(cfg)  # files that must exist, cores / GPUs / memory this machine has
        trainer: L.Trainer = build(cfg.trainer, callbacks=callbacks, logger=loggers)
    with guarded_fit(trainer, datamodule):
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    metric = trainer.callback_metrics.get(cfg.optimized_metric)
    logging.getLogger(__name__).info(
        "%s = %s; outputs in %s", cfg.optimized_metric, metric, cfg.paths.output_dir
    )
    return None if metric is None else float(metric)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    with this_job_for_ddp_children():  # -m with trainer.devices > 1: ranks re-run this job only
        return train(cfg)


if __name__ == "__main__":  # not in a spawned process that re-imports this file
    launch(main)  # config errors: one message, exit 2; the exit skips the interpreter's teardown
