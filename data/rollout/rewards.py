"""Reward calls that can be timed out *and killed*: the task's reward runs in a worker process.

With ``data.reward_timeout_s`` set, ``RolloutController.score`` sends each ``(row, text)`` to a
``RewardRunner``. The runner keeps a small pool of worker processes (default one), each holding
an unpickled copy of the task; a call is one round trip over a pipe. A call that overruns the
timeout gets its worker killed (terminate, then kill, with any processes the reward started)
and replaced by a fresh one, and raises ``RewardTimeout``; the controller then applies the
``data.reward_errors`` policy. Exceptions raised by the reward come back with their type and
message (and the worker's traceback as their cause). Without a timeout no runner is built: the
controller calls the reward inline, as before.

Why processes: a thread stuck in a reward cannot be stopped, so each timeout used to leak a
thread (and whatever it held) for the rest of the run. Why "spawn": the trainer process runs
threads and a vLLM engine, which ``fork`` would copy in an inconsistent state; "forkserver"
would leave its server process alive after ``close``. Why one call per round trip instead of
batches: the controllers score each response the moment it finishes (while the rest of the
batch is still generating), so there is no batch to send; a round trip costs about 40 us,
negligible next to generating a response.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from typing import Any

from modules.config.errors import ConfigError

# A fresh interpreter re-imports the task's module (and, under ``python train.py``, the main
# script's imports: torch, lightning) before it can score; that happens once per worker,
# overlapped with generation, and is not charged to the per-call timeout.
STARTUP_TIMEOUT_S = 300.0
# How long a terminated worker gets to exit before it is killed outright.
TERMINATE_GRACE_S = 1.0
# How often a worker checks that the trainer process is still alive.
PARENT_POLL_S = 0.5


class RewardTimeout(TimeoutError):
    """A reward call overran ``data.reward_timeout_s``; its worker process was killed."""


class RewardWorkerDied(RuntimeError):
    """The worker process died while scoring (e.g. the reward crashed the interpreter)."""


class RewardWorkerError(RuntimeError):
    """The runner itself cannot score: a worker failed to start, or the runner is closed.

    Not a failure of one reward call, so ``data.reward_errors=zero`` does not swallow it.
    """


class RemoteRewardError(RuntimeError):
    """Stands in for an exception raised by the reward that could not be sent back as is."""


class RemoteTraceback(Exception):
    """Carries the worker's traceback text; attached as the ``__cause__`` of a reward error."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


def pickle_task(task: Any) -> bytes:
    """The task as bytes for the workers; a task that cannot be pickled is a config error."""
    try:
        return pickle.dumps(task)
    except Exception as e:
        raise ConfigError(
            f"task {type(task).__module__}.{type(task).__qualname__} cannot be pickled ({e!r}), "
            "but data.reward_timeout_s runs rewards in a worker process, which needs a copy of "
            "`task`: define the task class at module level and keep no locks, open files, "
            "lambdas or engine handles on it, or set data.reward_timeout_s=null"
        ) from e


# ---------------------------------------------------------------------------- worker side
def _exit_when_orphaned(parent_pid: int) -> None:
    """If the trainer dies without closing the runner, the worker must not outlive it."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_main(conn: Connection, task_bytes: bytes, parent_pid: int) -> None:
    """Worker process: load the task, then answer ``(row, text)`` requests until EOF."""
    # Ctrl-C reaches the whole process group; the trainer decides when workers stop (close).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    try:
        task = pickle.loads(task_bytes)
    except BaseException as e:
        conn.send(("startup_error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the runner closed its end
            return
        if request is None:
            return
        row, text = request
        try:
            value = float(task.reward(row, text))
        except BaseException as e:
            conn.send(("error", _portable(e), type(e).__qualname__, str(e), traceback.format_exc()))
        else:
            conn.send(("ok", value))


def _portable(exc: BaseException) -> bytes | None:
    """The exception pickled, if it survives a round trip (custom exceptions often do not)."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:
        return None


# ---------------------------------------------------------------------------- trainer side
class _Worker:
    """One worker process and the trainer's end of its pipe."""

    def __init__(self, ctx: Any, task_bytes: bytes) -> None:
        self.conn, child_conn = ctx.Pipe(duplex=True)
        # daemon: multiprocessing terminates it at interpreter exit should close() be skipped.
        self.proc = ctx.Process(
            target=_worker_main,
            args=(child_conn, task_bytes, os.getpid()),
            name="asyncrl-reward",
            daemon=True,
        )
        self.proc.start()
        child_conn.close()  # keep only the worker's copy, so its death reads as EOF here
        self.ready = False

    def wait_ready(self) -> None:
        if self.ready:
            return
        if not self.conn.poll(STARTUP_TIMEOUT_S):
            raise RewardWorkerError(f"reward worker did not start within {STARTUP_TIMEOUT_S:g} s")
        try:
            tag, detail = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(TERMINATE_GRACE_S)
            raise RewardWorkerError(
                f"reward worker exited during start-up (exit code {self.proc.exitcode})"
            ) from None
        if tag != "ready":
            raise RewardWorkerError(f"reward worker could not load `task`: {detail}")
        self.ready = True

    def call(self, row: dict, text: str, timeout_s: float) -> float:
        """One reward; raises what the reward raised, ``RewardTimeout`` or ``RewardWorkerDied``."""
        try:
            self.conn.send((row, text))
        except BrokenPipeError:
            self.proc.join(TERMINATE_GRACE_S)
            raise RewardWorkerDied(
                f"reward worker process is gone (exit code {self.proc.exitcode})"
            ) from None
        if not self.conn.poll(timeout_s):
            raise RewardTimeout(f"reward took longer than data.reward_timeout_s={timeout_s:g} s")
        try:
            reply = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(TERMINATE_GRACE_S)
            raise RewardWorkerDied(
                f"reward worker process died while scoring (exit code {self.proc.exitcode})"
            ) from None
        if reply[0] == "ok":
            return reply[1]
        _, data, type_name, message, tb = reply
        try:
            exc = pickle.loads(data) if data is not None else None
        except Exception:
            exc = None
        if not isinstance(exc, Exception):  # unpicklable, or SystemExit & co.: must not end the trainer
            exc = RemoteRewardError(f"{type_name}: {message}")
        exc.__cause__ = RemoteTraceback(tb)
        raise exc

    def kill(self) -> None:
        """Stop the worker and whatever it started; returns once all of them are gone."""
        _stop(self.proc, self.conn)


def _stop(proc: Any, conn: Connection) -> None:
    """Terminate, then kill, a worker and its descendants (a reward may run subprocesses)."""
    descendants = []
    if proc.pid is not None and proc.is_alive():
        try:
            import psutil

            descendants = psutil.Process(proc.pid).children(recursive=True)
        except Exception:  # already gone, or psutil unavailable: the worker itself still stops
            descendants = []
    try:
        conn.close()
    except OSError:
        pass
    if proc.is_alive():
        proc.terminate()
        proc.join(TERMINATE_GRACE_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
    for child in descendants:
        try:
            child.kill()
        except Exception:  # exited on its own
            pass


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:
        _stop(w.proc, w.conn)


class RewardRunner:
    """Scores ``task.reward(row, text)`` in worker processes with a per-call timeout.

    Thread-safe: a caller takes an idle worker (waiting if all are busy), so concurrent
    callers never share a pipe. The controllers score one response at a time, so one worker
    is enough; ``workers`` > 1 only helps a caller that scores from several threads.
    ``timeout_s`` may be changed between calls (it is enforced here, not in the worker).
    """

    def __init__(self, task: Any, timeout_s: float, workers: int = 1) -> None:
        self.timeout_s = timeout_s
        self._task_bytes = pickle_task(task)  # fail at start-up, not at the first reward
        self._ctx = mp.get_context("spawn")
        self._cond = threading.Condition()
        self._closed = False
        self.restarts = 0
        # Started now, so the interpreter start-up overlaps with generating the first responses.
        self._workers = [_Worker(self._ctx, self._task_bytes) for _ in range(workers)]
        self._idle = list(self._workers)
        # Safety net for a runner dropped without close(): its workers still stop.
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    @property
    def pids(self) -> list[int]:
        """Current worker process ids (for tests and diagnostics)."""
        with self._cond:
            return [w.proc.pid for w in self._workers if w.proc.pid is not None]

    def __call__(self, row: dict, text: str) -> float:
        worker = self._acquire()
        try:
            if worker.ready and not worker.proc.is_alive():
                # Died while idle (e.g. the OOM killer): not this call's fault, so not an error.
                worker = self._replace(worker)
            worker.wait_ready()
            return worker.call(row, text, self.timeout_s)
        except (RewardTimeout, RewardWorkerDied):
            # The worker is stuck or gone: stop it and put a fresh one in its place.
            worker = self._replace(worker)
            raise
        except (EOFError, OSError) as e:
            if self._closed:  # close() stopped this worker mid-call
                raise RewardWorkerError("reward runner was closed during the call") from e
            raise
        finally:
            self._release(worker)

    def _acquire(self) -> _Worker:
        with self._cond:
            while not self._idle and not self._closed:
                self._cond.wait()
            if self._closed:
                raise RewardWorkerError("reward runner is closed")
            return self._idle.pop()

    def _release(self, worker: _Worker) -> None:
        with self._cond:
            if worker in self._workers:
                self._idle.append(worker)
            self._cond.notify()

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        with self._cond:
            if self._closed or worker not in self._workers:
                return worker
            fresh = _Worker(self._ctx, self._task_bytes)
            self._workers[self._workers.index(worker)] = fresh
            self.restarts += 1
            return fresh

    def close(self) -> None:
        """Stop every worker (idle or busy); safe to call twice. Later calls raise."""
        with self._cond:
            self._closed = True
            workers, self._idle = list(self._workers), []
            self._workers.clear()
            self._cond.notify_all()
        _stop_all(workers)
        self._finalizer.detach()
