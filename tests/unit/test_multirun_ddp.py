"""Hydra multirun x DDP: the command Lightning relaunches ranks > 0 with runs one job only."""

from __future__ import annotations

import sys

from modules.launch.multirun import job_argv, this_job_for_ddp_children


def test_a_job_command_line_has_no_sweep():
    argv = ["train.py", "-m", "seed=0,1", "trainer.devices=2", "--config-name", "train", "-cd=conf"]
    assert job_argv(argv, ["seed=1", "trainer.devices=2"]) == [
        "train.py",
        "--config-name",
        "train",
        "-cd=conf",
        "seed=1",
        "trainer.devices=2",
    ]
    assert job_argv(["train.py", "--multirun", "a=1,2"], ["a=2"]) == ["train.py", "a=2"]
    hydra = ["hydra.mode=MULTIRUN", "hydra.sweep.dir=/tmp/x", "hydra.job.chdir=true", "hydra.run.dir=y"]
    assert job_argv(["train.py", "-m", "a=1,2"], ["a=1"], hydra) == [
        "train.py",
        "hydra.job.chdir=true",
        "a=1",
    ]


def test_outside_hydra_nothing_changes():
    before = list(sys.argv)
    with this_job_for_ddp_children():
        assert sys.argv == before
