"""How the trainer stops the engine's processes (modules/engine/stop.py), on real processes."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from modules.engine import stop


def test_a_core_that_sleeps_through_sigterm_gets_it_again():
    """``modules/engine/stop.py``: while vLLM stops the engine, a core process still running
    after RESEND_SIGTERM_S is sent SIGTERM again. Here a process that swallows its first SIGTERM
    (as an idle engine core here did about 1 stop in 4 under load) exits on the second."""
    script = (
        "import signal, sys, time\n"
        "seen = []\n"
        "def on_term(s, f):\n"
        "    seen.append(s)\n"
        "    if len(seen) > 1: sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "print('ready', flush=True)\n"
        "while True: time.sleep(0.05)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        with stop._sigterm_again([psutil.Process(proc.pid)]):
            proc.terminate()  # the first SIGTERM, which it ignores
            assert proc.wait(timeout=stop.RESEND_SIGTERM_S + 10) == 0
        assert stop.RESEND_SIGTERM_S <= time.monotonic() - t0 < stop.RESEND_SIGTERM_S + 10
    finally:
        proc.kill()
        proc.wait()
