"""How the trainer stops the engine's processes (modules/engine/stop.py), on real processes."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from modules.engine import stop

# A stand-in for an engine core: prints "ready", then acts on SIGTERM as ``ON_TERM`` says.
CORE = """
import signal, sys, time
seen = []
def on_term(s, f):
    seen.append(s)
{ON_TERM}
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""
# swallows its first SIGTERM (as an idle engine core here did about 1 stop in 4 under load)
SWALLOWS_FIRST = "    if len(seen) > 1: sys.exit(0)"
# acts on the first: restores the default action, then takes 2 s to leave cleanly (vLLM's core
# restores SIG_DFL as it starts to exit); a second SIGTERM would kill it (-15)
LEAVES_SLOWLY = "    signal.signal(signal.SIGTERM, signal.SIG_DFL); time.sleep(2.0); sys.exit(0)"


def stopped_with_resend(on_term: str, monkeypatch) -> tuple[int, float]:
    """Start the stand-in, send it one SIGTERM inside ``_sigterm_again``; its exit code and
    the seconds it took."""
    monkeypatch.setattr(stop, "RESEND_SIGTERM_S", 0.3)
    proc = subprocess.Popen(
        [sys.executable, "-c", CORE.format(ON_TERM=on_term)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        with stop._sigterm_again([psutil.Process(proc.pid)]):
            proc.terminate()  # vLLM's one SIGTERM
            code = proc.wait(timeout=15)
        return code, time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()


def test_a_core_that_sleeps_through_sigterm_gets_it_again(monkeypatch):
    code, seconds = stopped_with_resend(SWALLOWS_FIRST, monkeypatch)
    assert code == 0 and seconds < 5


def test_a_core_already_leaving_is_not_sent_sigterm_again(monkeypatch):
    """Once the core has restored SIGTERM's default action it is leaving: a second SIGTERM
    would turn its clean exit into -15, so none is sent."""
    code, seconds = stopped_with_resend(LEAVES_SLOWLY, monkeypatch)
    assert code == 0 and seconds >= 2.0
