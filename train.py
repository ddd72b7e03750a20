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

import modules.launch.compose  # noqa: F401  registers the resolvers conf/ uses
from modules.launch.cli import launch
from modules.launch.multirun import this_job_for_ddp_children
from modules.launch.quiet import quiet_console, quiet_run_dir

# here, not under __main__: the processes this run spawns re-import this file first (quiet.py)
quiet_console(spawned=__name__ == "__mp_main__")


def train(cfg: DictConfig) -> float | None:
    from modules.callbacks.held_out import held_out_summary
    from modules.launch.guard import guarded_fit
    from modules.launch.start import build_run

    quiet_run_dir(cfg.paths.output_dir)  # Hydra's files in it are no reason to warn (quiet.py)
    # a bad value exits 2 with one message naming it (modules/launch/cli.py)
    datamodule, module, trainer = build_run(cfg)
    with guarded_fit(trainer, datamodule):
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    metric = trainer.callback_metrics.get(cfg.optimized_metric)
    metric = None if metric is None else float(metric)  # the value Hydra sweepers read
    logging.getLogger(__name__).info(
        "%s = %s; outputs in %s", cfg.optimized_metric, metric, cfg.paths.output_dir
    )
    if summary := held_out_summary(trainer):  # last on the console: before -> after, framed
        logging.getLogger(__name__).info("held-out reward, first -> last evaluation:\n%s", summary)
    return metric


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    with this_job_for_ddp_children():  # -m with trainer.devices > 1: ranks re-run this job only
        return train(cfg)


if __name__ == "__main__":  # not in a spawned process that re-imports this file
    launch(main)  # config errors: one message, exit 2; the exit skips the interpreter's teardown
