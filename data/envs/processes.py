"""CPU-bound tools in worker processes, so that a timeout can stop them.

    from data.envs.processes import ProcessTool
    run_code = ProcessTool(execute_snippet, workers=4, memory_mb=2048, cpu_s=10)
    result = await self.tools.call(run_code.call, source)  # in Environment.step

A plain function on a thread (``ToolRunner``'s default) cannot be stopped: when it times out
the episode moves on, but a CPU-bound tool keeps spinning on its thread and holds the GIL
share of every other thread of the trainer process (the rollout, the engine's client, the
trainer's own Python). ``ProcessTool`` runs it in a worker process instead: the call waits on
the worker from a daemon thread, and when ``ToolRunner``'s timeout cancels the call, the
worker is killed (the next call starts a fresh one). Workers are started on demand, reused
while they are well, and at most ``workers`` idle ones are kept; the concurrency limit of the
``ToolRunner`` bounds how many run at once. The function and its arguments must pickle (a
module-level function; a worker imports its module at its first call).

Each worker leads a process group of its own (``os.setsid`` first thing), and a kill is a
SIGKILL to the whole group: what the tool started (``subprocess``) dies with it, at a timeout
and at ``close`` (which stops busy workers too). A process that leaves the group (its own
``setsid``, ``start_new_session=True``) escapes. Limits, set in the worker before it serves
(not a sandbox: a tool may raise its own soft limits):

* ``memory_mb``: the worker's address space (``RLIMIT_AS``; the interpreter and the tool's
  imports count, so leave room for them): an allocation beyond it raises ``MemoryError``, a
  tool error, and the worker is retired (the next call gets a fresh one);
* ``cpu_s``: CPU seconds per call (``RLIMIT_CPU``, renewed before each call, whole seconds):
  beyond it the kernel kills the worker (SIGXCPU), a tool error naming the signal.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import pickle
import resource
import signal
import threading
from collections.abc import Callable
from typing import Any

from data.envs.threads import on_daemon_thread


def _limit(memory_mb: int | None) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a worker killed by SIGXCPU dumps no core
    if memory_mb is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))


def _renew_cpu(cpu_s: float | None) -> None:
    """Allow ``cpu_s`` more CPU seconds than this worker has used so far."""
    if cpu_s is None:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + cpu_s)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(
        resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard)
    )


def _serve(conn: Any, memory_mb: int | None, cpu_s: float | None) -> None:
    """A worker: a process group of its own and its limits, then serve calls; whenever it
    ends (the parent gone, a SIGTERM at the parent's exit), the rest of its group dies too."""
    os.setsid()
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    try:
        _limit(memory_mb)
    except Exception as e:  # noqa: BLE001 - reported by _Worker
        conn.send((False, f"cannot set the worker's limits: {type(e).__name__}: {e}", True))
        return
    try:
        conn.send((True, None, False))  # ready: its group exists, a kill reaches it
        _serve_calls(conn, memory_mb, cpu_s)
    finally:
        os.killpg(0, signal.SIGKILL)  # what the tools started, and this worker


def _serve_calls(conn: Any, memory_mb: int | None, cpu_s: float | None) -> None:
    """Receive (fn, args), send back (ok, output or error text, retire)."""
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        retire = False
        try:
            _renew_cpu(cpu_s)
            fn, args = pickle.loads(message)  # the tool's module is imported here
            reply = (True, fn(*args), False)
        except MemoryError:
            retire = True  # a heap at its limit: the next call gets a fresh worker
            reply = (False, f"MemoryError: the tool ran out of memory (memory_mb={memory_mb})", True)
        except BaseException as e:  # noqa: BLE001 - SystemExit too: the tool's failure, as its text
            reply = (False, f"{type(e).__name__}: {e}", False)
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - an output that does not pickle
            conn.send((False, f"the tool's output cannot be sent back: {type(e).__name__}: {e}", False))
        if retire:
            return


class WorkerDied(RuntimeError):
    pass


class _Worker:
    def __init__(self, ctx: Any, memory_mb: int | None, cpu_s: float | None) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, memory_mb, cpu_s), daemon=True, name="asyncrl-tool"
        )
        self.process.start()
        child.close()
        self._dead, self._lock = False, threading.Lock()
        try:
            ok, error, _ = self.conn.recv()  # after its setsid: a kill reaches its whole group
        except (EOFError, OSError):
            ok, error = False, self._death()
        if not ok:
            self.kill(reap=False)
            self.process.join(5)
            self.conn.close()
            raise WorkerDied(f"the tool's worker process failed to start: {error}")

    def run(self, fn: Callable[..., Any], args: tuple) -> tuple[bool, Any, bool]:
        payload = pickle.dumps((fn, args))  # a PicklingError stays in this process
        try:
            self.conn.send_bytes(payload)
            return self.conn.recv()
        except (EOFError, OSError):  # killed, or died
            raise WorkerDied(f"the tool's worker process died ({self._death()})") from None

    def _death(self) -> str:
        self.process.join(1)
        code = self.process.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            return f"killed by {name}" + (": over its cpu_s limit" if name == "SIGXCPU" else "")
        return f"exit code {code}"

    def kill(self, reap: bool = True) -> None:
        """SIGKILL to the worker's process group now (once: the group id is the worker's pid,
        which another process may get once it is reaped); the reaping (a join) on a daemon
        thread, off the episode loop, unless ``reap`` is False (the caller joins)."""
        with self._lock:
            if self._dead:
                return
            self._dead = True
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone with every process of its group
            pass
        self.process.kill()  # no-op if reaped
        if reap:
            threading.Thread(target=self.reap, name="asyncrl-tool-reap", daemon=True).start()

    def reap(self) -> None:
        self.process.join(5)
        self.conn.close()


class ProcessTool:
    def __init__(
        self,
        fn: Callable[..., Any],
        workers: int = 2,
        start_method: str = "spawn",
        memory_mb: int | None = None,
        cpu_s: float | None = None,
    ) -> None:
        # arguments of code that builds the tool (an environment), not config fields
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"ProcessTool: workers={workers!r}: must be an int >= 1")
        methods = multiprocessing.get_all_start_methods()
        if start_method not in methods:
            raise ValueError(
                f"ProcessTool: start_method={start_method!r}: must be one of {', '.join(methods)}"
            )
        if not (
            memory_mb is None
            or (isinstance(memory_mb, int) and not isinstance(memory_mb, bool) and memory_mb >= 1)
        ):
            raise ValueError(f"ProcessTool: memory_mb={memory_mb!r}: must be None (no limit) or an int >= 1")
        number = isinstance(cpu_s, (int, float)) and not isinstance(cpu_s, bool)
        if not (cpu_s is None or (number and math.isfinite(cpu_s) and cpu_s > 0)):
            raise ValueError(f"ProcessTool: cpu_s={cpu_s!r}: must be None (no limit) or a float > 0")
        self.fn, self.workers = fn, workers
        self.memory_mb, self.cpu_s = memory_mb, None if cpu_s is None else float(cpu_s)
        self._ctx = multiprocessing.get_context(start_method)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.killed = 0  # workers killed at a timeout, found dead or retired at a limit

    async def call(self, *args: Any) -> Any:
        """``fn(*args)`` in a worker process; raises the tool's error, or ``RuntimeError`` if the
        worker died; a cancellation (the ``ToolRunner`` timeout) kills the worker."""
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            starting = asyncio.ensure_future(on_daemon_thread(self._start_worker, ()))
            try:
                worker = await asyncio.shield(starting)
            except asyncio.CancelledError:  # timed out while it started: stop it once it has
                starting.add_done_callback(self._discard_started)
                raise
        with self._lock:
            self._busy.add(worker)
        try:
            ok, output, retire = await on_daemon_thread(worker.run, (self.fn, args))
        except asyncio.CancelledError:
            self._discard(worker)
            raise
        except WorkerDied:
            self._discard(worker)
            raise
        except BaseException:  # e.g. arguments that do not pickle: the worker is still well
            self._return(worker)
            raise
        if retire:
            self._discard(worker)
        else:
            self._return(worker)
        if not ok:
            raise RuntimeError(output)
        return output

    def _start_worker(self) -> _Worker:
        """A new worker, counted as busy from birth (on its starting thread): a call that times
        out while it starts, or a close meanwhile, still finds and kills it."""
        worker = _Worker(self._ctx, self.memory_mb, self.cpu_s)
        with self._lock:
            closed = self._closed
            if not closed:
                self._busy.add(worker)
        if closed:
            worker.kill()
            raise RuntimeError("ProcessTool is closed")
        return worker

    def _discard_started(self, starting: asyncio.Future) -> None:
        if not starting.cancelled() and starting.exception() is None:
            self._discard(starting.result())

    def _return(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
            if not self._closed and len(self._idle) < self.workers:
                self._idle.append(worker)
                return
        worker.kill()

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._busy.discard(worker)
            self.killed += 1

    def close(self) -> None:
        """Kill every worker, idle or busy, with its process group (a call in flight fails as
        a tool error), and reap them."""
        with self._lock:
            self._closed = True
            workers, self._idle = self._idle + list(self._busy), []
            self._busy = set()
        for worker in workers:
            worker.kill(reap=False)
        for worker in workers:
            worker.reap()
