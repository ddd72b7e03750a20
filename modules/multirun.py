"""Hydra multirun x DDP: make the processes Lightning launches for ranks > 0 re-run this job.

    python train.py -m seed=0,1 trainer.devices=2     # two jobs, each trained by two ranks

Lightning starts rank r > 0 of a Hydra app as ``sys.argv`` plus ``hydra.run.dir=<run.dir>``
(``lightning.fabric.strategies.launchers.subprocess_script._hydra_subprocess_cmd``). In a
multirun ``sys.argv`` still holds ``-m`` and the sweep lists, so every child would start a sweep
of its own, and ``run.dir`` is the single-run pattern, not the job's directory. While a job
trains, ``this_job_for_ddp_children`` makes ``sys.argv`` this job's own overrides (no ``-m``)
and ``hydra.run.dir`` the job's output directory; both are restored after the job.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

# Flags of Hydra's command line that take a value (kept for the children, with the value).
_VALUE_FLAGS = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd")


def job_argv(argv: list[str], task_overrides: list[str]) -> list[str]:
    """The command line of one multirun job: the program and its config flags, no ``-m``, and
    the job's own overrides instead of the sweep's."""
    out = [argv[0]]
    args = iter(argv[1:])
    for a in args:
        if a in _VALUE_FLAGS:
            out += [a, next(args, "")]
        elif a.split("=", 1)[0] in _VALUE_FLAGS:
            out.append(a)
    return out + list(task_overrides)


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
    sys.argv = job_argv(saved_argv, list(hydra_cfg.overrides.task))
    with read_write(hydra_cfg.run):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir
    try:
        yield
    finally:
        sys.argv = saved_argv
        with read_write(hydra_cfg.run):
            hydra_cfg.run.dir = saved_dir
