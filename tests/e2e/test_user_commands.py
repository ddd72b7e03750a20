"""Commands exactly as a user types them: no PROJECT_ROOT (the Makefile and conftest export
it), started from another directory. Hydra's multirun resolves its sweep dir before any job
runs, so the project root must not depend on a job's runtime."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.conftest import ROOT


def test_a_multirun_outside_make_reaches_its_jobs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PROJECT_ROOT"}
    sweeps = ROOT / "multirun"
    before = set(sweeps.iterdir()) if sweeps.exists() else set()
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), "-m", "seed=0,1", "rollout.group_size=-1"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        for new in (set(sweeps.iterdir()) if sweeps.exists() else set()) - before:
            shutil.rmtree(new, ignore_errors=True)
    # the sweep started its first job, whose bad value was refused naming the field
    assert proc.returncode != 0
    assert "InterpolationResolutionError" not in proc.stderr, proc.stderr[-2000:]
    assert "rollout.group_size" in proc.stderr and ">= 1" in proc.stderr, proc.stderr[-2000:]
    assert "Launching 2 jobs" in proc.stdout + proc.stderr
