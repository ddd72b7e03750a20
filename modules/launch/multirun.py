"""Hydra multirun x DDP: make the processes Lightning launches for ranks > 0 re-run this job.

    python train.py -m seed=0,1 trainer.devices=2     # two jobs, each trained by two ranks

Lightning starts rank r > 0 of a Hydra app as ``sys.argv`` plus ``hydra.run.dir=<run.dir>``
(``lightning.fabric.strategies.launchers.subprocess_script._hydra_subprocess_cmd``). In a
multirun ``sys.argv`` still holds ``-m`` and the sweep lists, so every child would start a sweep
of its own, and ``run.dir`` is the single-run pattern, not the job's directory. While a job
trains, ``this_job_for_ddp_children`` makes ``sys.argv`` this job's own overrides (no ``-m``)
and ``hydra.run.dir`` the job's output directory; both are restored after the job.

After the job it also undoes what Lightning's launcher left in this process: the environment
it set for its children (``LOCAL_RANK`` makes the next job believe its ranks were started from
outside, so none is launched; ``MASTER_PORT`` would be reused) and the process group (the next
job would find one initialised, with a peer that has exited).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

# Flags of Hydra's command line that take a value (kept for the children, with the value).
_VALUE_FLAGS = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd")
# Hydra overrides of a multirun job that a single run must not get (Lightning adds its own
# hydra.run.dir, hydra.job.name and hydra.output_subdir).
_SWEEP_ONLY = (
    "hydra.mode",
    "hydra.sweep",
    "hydra.run.dir",
    "hydra.job.name",
    "hydra.output_subdir",
    "hydra/sweeper",
)
# What Lightning's subprocess launcher sets in the parent's environment for its children.
_LAUNCHER_ENV = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def job_argv(argv: list[str], task_overrides: list[str], hydra_overrides: list[str] = ()) -> list[str]:
    """The command line of one multirun job: the program and its config flags, no ``-m``, the
    user's Hydra overrides that a single run keeps, and the job's own overrides."""
    out = [argv[0]]
    args = iter(argv[1:])
    for a in args:
        if a in _VALUE_FLAGS:
            out += [a, next(args, "")]
        elif a.split("=", 1)[0] in _VALUE_FLAGS:
            out.append(a)
    kept = [o for o in hydra_overrides if not o.lstrip("+~").startswith(_SWEEP_ONLY)]
    return out + kept + list(task_overrides)


@contextlib.contextmanager
def this_job_for_ddp_children() -> Iterator[None]:
    """No-op outside a Hydra multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import read_write

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        yield
        return
    hydra_cfg = HydraConfig.get()
    saved_argv, saved_dir = list(sys.argv), hydra_cfg.run.dir
    saved_env = {k: os.environ.get(k) for k in _LAUNCHER_ENV}
    sys.argv = job_argv(saved_argv, list(hydra_cfg.overrides.task), list(hydra_cfg.overrides.hydra))
    with read_write(hydra_cfg.run):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir
    try:
        yield
    finally:
        sys.argv = saved_argv
        with read_write(hydra_cfg.run):
            hydra_cfg.run.dir = saved_dir
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
