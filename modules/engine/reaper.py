"""Kill the engine's processes if the trainer dies without shutting them down.

vLLM's engine core is a child process that does not notice its parent's death: after a
``kill -9`` of the trainer (or Lightning's DDP observer killing rank 0 when another rank
dies, or a SIGTERM that lands while the engine is still starting) it would live on, holding
its cores or GPUs. ``VLLMEngine.start`` launches this tiny watcher *before* it builds the
engine and keeps the write end of a pipe to it:

* while the engine is being built, the watcher records every new descendant of the trainer
  (the engine core and its workers as they appear);
* once the build is done, the trainer sends the exact process ids of its engine (``freeze``)
  and the watcher stops looking;
* the pipe closes when the trainer exits, however it exits (or the trainer disappears), and
  the watcher then kills whatever of those processes is still alive (after a normal
  shutdown: nothing) and, if the trainer is gone, removes the weight file a sync in progress
  left in shared memory.

    python -m modules.engine.reaper TRAINER_PID [IGNORED_PID ...]   # what launch() runs
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time

POLL_S = 0.1
GRACE_S = 5.0  # a normal shutdown finishing on its own


def launch(ignore: set[int]) -> subprocess.Popen:
    """Start the watcher over this process's new descendants (``ignore``: those that exist
    already) and return once it watches. It fires when this process closes the returned pipe
    (``.stdin``) or dies."""
    watcher = subprocess.Popen(
        [sys.executable, "-m", "modules.engine.reaper", str(os.getpid()), *map(str, sorted(ignore))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert watcher.stdout is not None
    watcher.stdout.read(1)  # its first look at our descendants is done (or it died: b"")
    return watcher


def freeze(watcher: subprocess.Popen, pids: set[int]) -> None:
    """The build is done: the watcher guards exactly ``pids`` from now on."""
    assert watcher.stdin is not None
    watcher.stdin.write(" ".join(map(str, sorted(pids))).encode() + b"\n")
    watcher.stdin.flush()


def child_pids() -> set[int]:
    """Process ids of this process's descendants now."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def engine_pids(before: set[int], exclude: set[int] = frozenset()) -> set[int]:
    """Descendants started since ``before`` was taken, except multiprocessing's resource
    tracker (vLLM spawns it with the engine, but it serves this whole process and must
    outlive the engine) and ``exclude``."""
    import psutil

    new = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if (
                p.pid not in before
                and p.pid not in exclude
                and "resource_tracker" not in " ".join(p.cmdline())
            ):
                new.add(p.pid)
        except psutil.Error:
            continue
    return new


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Watch:
    def __init__(self, trainer: int, ignore: set[int]) -> None:
        self.trainer, self.ignore = trainer, ignore | {os.getpid()}
        self.guarded: set[int] = set()
        self.frozen = threading.Event()
        self.fired = threading.Event()
        self.watching = threading.Event()
        self.lock = threading.Lock()

    def read_pipe(self) -> None:
        """A line: the final pids (frozen). EOF: the trainer closed the pipe or died."""
        for line in sys.stdin.buffer:
            with self.lock:
                self.guarded = {int(x) for x in line.split()}
                self.frozen.set()
        self.fired.set()

    def poll(self) -> None:
        """Until frozen: record the trainer's new descendants; the trainer gone also fires."""
        import psutil

        while not self.frozen.is_set() and not self.fired.is_set():
            try:
                found = {p.pid for p in psutil.Process(self.trainer).children(recursive=True)}
            except psutil.NoSuchProcess:
                self.fired.set()
                return
            with self.lock:
                if not self.frozen.is_set():
                    self.guarded |= found - self.ignore
            if not self.watching.is_set():
                sys.stdout.write("w")  # launch() returns: nothing the trainer starts now escapes
                sys.stdout.flush()
                self.watching.set()
            time.sleep(POLL_S)


def _is_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return False


def main(trainer: int, ignore: set[int]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer, not for us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as is a scheduler's SIGTERM to the group
    watch = _Watch(trainer, ignore)
    threading.Thread(target=watch.read_pipe, daemon=True).start()
    threading.Thread(target=watch.poll, daemon=True).start()
    watch.fired.wait()
    with watch.lock:
        pids = [p for p in watch.guarded if not _is_tracker(p)]
    # Give a normal shutdown a moment to finish on its own, then make sure.
    deadline = time.monotonic() + GRACE_S
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if not _alive(trainer):  # killed mid weight sync: its shared-memory weight file stays behind
        remove_weight_files(trainer)


def scratch_prefix(pid: int) -> str:
    """Name prefix of the weight files process ``pid`` writes (``shm_transfer.prepared``)."""
    return f"asyncrl-weights-{pid}-"


def remove_weight_files(pid: int) -> None:
    """Remove what a killed trainer ``pid`` left in /dev/shm or the temp dir."""
    import tempfile

    for folder in ("/dev/shm", tempfile.gettempdir()):
        for path in glob.glob(os.path.join(folder, scratch_prefix(pid) + "*")):
            try:
                os.unlink(path)
            except OSError:
                pass


if __name__ == "__main__":
    main(int(sys.argv[1]), {int(a) for a in sys.argv[2:]})
