"""The pipeline simulator: real controllers on a virtual clock, checked against analytical values."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_cli_prints_json_with_bounds(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.pipeline",
            "rollout=partial",
            "sim.steps=20",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mode"] == "PartialRollout" and out["bounds"]["pipeline_bound_samples_per_unit"] > 0
