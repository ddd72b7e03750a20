"""Every recipe composes; bad values fail at start-up, naming the field, before any engine."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT


def run_train(*overrides: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout=streamingg", ["rollout", "sync"]),  # unknown mode: Hydra lists the options
        ("rollout.group_size=-1", ["rollout.group_size", ">= 1"]),
        ("rollout.prompts_per_step=0", ["rollout.prompts_per_step", ">= 1"]),
        ("rollout.sampling.temperature=0", ["rollout.sampling.temperature", "> 0"]),
        ("rollout.sampling.top_p=1.5", ["rollout.sampling.top_p", "(0, 1]"]),
        ("algo.minibatches=0", ["algo.minibatches", ">= 1"]),
        ("engine.dtype=int3", ["engine.dtype", "float32"]),
    ],
)
def test_bad_value_fails_fast_naming_the_field(override, expected, tmp_path):
    t0 = time.monotonic()
    proc = run_train(override, f"hydra.run.dir={tmp_path}")
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    for word in expected:
        assert word in proc.stderr, proc.stderr[-2000:]
    assert "EngineCore" not in proc.stderr  # failed before any engine was built
    assert elapsed < 60
