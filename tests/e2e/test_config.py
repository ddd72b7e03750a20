"""Every recipe composes; bad values fail at start-up, naming the field, before any engine."""

from __future__ import annotations

import os
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
        ("rollout=streamingg", ["rollout", "sync", "streaming"]),  # Hydra's: it lists the options
        ("rollout.group_size=-1", ["rollout.group_size=-1", ">= 1"]),  # ours: field, value, range
    ],
)
def test_bad_value_fails_fast_naming_the_field(override, expected, tmp_path):
    """As a user types it: exit code 2, one message naming the field (and for ours the value and
    what is allowed), no traceback, before any engine. Every other bad input of
    docs/bad_inputs.yaml goes through the same start-up in-process (tests/unit)."""
    t0 = time.monotonic()
    proc = run_train(override, f"hydra.run.dir={tmp_path}")
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-2000:]
    for word in expected:
        assert word in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR=1" in proc.stderr
    assert "EngineCore" not in proc.stderr  # failed before any engine was built
    assert elapsed < 60
    full = subprocess.run(
        [sys.executable, "train.py", override, f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
    )
    assert full.returncode != 0 and "Traceback" in full.stderr  # asked for: the traceback
