"""The GPU smoke script cannot run here; what can: it stops at once, exit 2, with a report
that says why, and its runs are the GPU configs the README documents."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_without_a_gpu_it_stops_with_exit_2_and_a_report(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tools.gpu_smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU" in proc.stderr
    assert "no CUDA GPU" in (tmp_path / "report.txt").read_text()
