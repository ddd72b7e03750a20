"""Signals while the engine starts: SIGTERM unwinds the start-up (exit 143, the engine stopped),
and a trainer killed outright leaves nothing either (the reaper watches before the build).
The training phase and Ctrl-C are in test_stops.py, kill -9 + resume in test_resume.py."""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import time

import pytest

from modules.engine.reaper import scratch_prefix
from tests.conftest import DEFAULT_EXECUTOR
from tests.e2e.runs import session_processes, start, wait_gone

pytestmark = pytest.mark.e2e


def engine_starting(pid: int) -> bool:
    """The engine core runs (it names itself once imported) and no step has been trained."""
    for p in session_processes(pid):
        try:
            if p.pid != pid and "VLLM" in p.name():
                return True
        except Exception:
            continue
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_signal_while_the_engine_starts_leaves_no_process_behind(tmp_path, models, sig):
    proc = start(
        tmp_path,
        models["tied"],
        "task._target_=tests.helpers.DigitShareTask",
        "trainer.max_steps=1000",
        "data.eval_size=0",
        DEFAULT_EXECUTOR,  # vLLM's own layout: the engine core starts a worker process too
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not engine_starting(proc.pid):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    assert engine_starting(proc.pid) and not (tmp_path / "trained_prompts.jsonl").exists()
    t0 = time.monotonic()
    os.kill(proc.pid, sig)  # the trainer only, as a scheduler or the OOM killer would
    _, err = proc.communicate(timeout=120)
    if sig == signal.SIGTERM:
        assert proc.returncode == 143, err[-3000:]
        assert not (tmp_path / "checkpoints" / "interrupted.ckpt").exists()  # nothing trained yet
    left = wait_gone(proc.pid, 30)
    print(f"FAULT-TIMING {sig.name} during engine start-up -> all gone in {time.monotonic() - t0:.2f} s")
    assert not left, f"processes outlived {sig.name} during engine start-up: {left}"
    # the killed trainer's weight files (only its own: other runs may be syncing meanwhile)
    mine = scratch_prefix(proc.pid)
    assert not glob.glob(f"/dev/shm/{mine}*") and not glob.glob(f"{tempfile.gettempdir()}/{mine}*")
