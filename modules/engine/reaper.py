"""Kill the engine's processes if the trainer dies without shutting them down.

vLLM's engine core is a child process that does not notice its parent's death: after a
``kill -9`` of the trainer (or Lightning's DDP observer killing rank 0 when another rank
dies) it would live on, holding its cores or GPUs. ``VLLMEngine.start`` launches this tiny
watcher (``watch_children``) with the engine's process ids and keeps the write end of a pipe to it; the pipe
closes when the trainer exits, however it exits, and the watcher then kills whatever of those
processes is still alive (after a normal shutdown: nothing).

    python -m modules.engine.reaper PID [PID ...]     # reads stdin until EOF, then kills the PIDs
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def launch(pids: list[int]) -> subprocess.Popen:
    """Start the watcher for ``pids``; it fires when this process closes the returned pipe
    (``.stdin``) or dies."""
    return subprocess.Popen(
        [sys.executable, "-m", "modules.engine.reaper", *map(str, pids)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def child_pids() -> set[int]:
    """Process ids of this process's descendants now."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def watch_children(before: set[int]) -> subprocess.Popen | None:
    """Launch the watcher for the descendants started since ``before`` was taken (the engine
    core and its workers); None if there are none."""
    import psutil

    new = []
    for p in psutil.Process().children(recursive=True):
        try:
            # multiprocessing's resource tracker may start with the engine (vLLM spawns)
            # but serves this whole process: it must outlive the engine.
            if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline()):
                new.append(p.pid)
        except psutil.Error:
            continue
    return launch(new) if new else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(pids: list[int]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer, not for us
    sys.stdin.buffer.read()  # returns at EOF: the trainer closed the pipe or died
    # Give a normal shutdown a moment to finish on its own, then make sure.
    deadline = time.monotonic() + 5.0
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]])
