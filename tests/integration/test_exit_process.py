"""train.py's exit (modules/launch/exit.py) in a real interpreter: threads, pools, handlers, code."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

SCRIPT = textwrap.dedent(
    """
    import atexit, concurrent.futures, sys, threading, time
    from modules.launch.exit import exit_when_done

    def main():
        pool = concurrent.futures.ThreadPoolExecutor(2)  # never shut down: must not hang the exit
        pool.submit(time.sleep, 0.1).result()
        def late():
            time.sleep(0.3)
            print("thread done", flush=True)
        threading.Thread(target=late).start()  # not a daemon: waited for
        atexit.register(lambda: print("atexit handler", flush=True))
        sys.stdout.write("buffered, not flushed")
        raise SystemExit(3)

    exit_when_done(main)
    """
)


def test_the_exit_waits_for_threads_runs_handlers_flushes_and_keeps_the_code():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3, proc.stderr
    lines = proc.stdout.replace("buffered, not flushed", "").split()
    assert proc.stdout.index("thread done") < proc.stdout.index("atexit handler")
    assert "buffered, not flushed" in proc.stdout and lines
