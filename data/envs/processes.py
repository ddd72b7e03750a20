"""CPU-bound tools in worker processes, so that a timeout can stop them.

    from data.envs.processes import ProcessTool
    run_code = ProcessTool(execute_snippet, workers=4)    # a module-level function
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
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import threading
from collections.abc import Callable
from typing import Any

from data.envs.tools import on_daemon_thread


def _serve(conn: Any) -> None:
    """A worker's loop: receive (fn, args), send back (ok, output or error text)."""
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            fn, args = pickle.loads(message)  # the tool's module is imported here
            reply = (True, fn(*args))
        except Exception as e:  # noqa: BLE001 - the tool's failure goes back as its text
            reply = (False, f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - an output that does not pickle
            conn.send((False, f"the tool's output cannot be sent back: {type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), daemon=True, name="asyncrl-tool")
        self.process.start()
        child.close()

    def run(self, fn: Callable[..., Any], args: tuple) -> tuple[bool, Any]:
        self.conn.send_bytes(pickle.dumps((fn, args)))  # a PicklingError stays in this process
        return self.conn.recv()  # EOFError if the worker was killed or died

    def kill(self) -> None:
        """SIGKILL now; the reaping (a join) on a daemon thread, off the episode loop."""
        self.process.kill()
        self.conn.close()
        threading.Thread(target=self.process.join, args=(5,), daemon=True).start()


class ProcessTool:
    def __init__(self, fn: Callable[..., Any], workers: int = 2, start_method: str = "spawn") -> None:
        # arguments of code that builds the tool (an environment), not config fields
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"ProcessTool: workers={workers!r}: must be an int >= 1")
        methods = multiprocessing.get_all_start_methods()
        if start_method not in methods:
            raise ValueError(
                f"ProcessTool: start_method={start_method!r}: must be one of {', '.join(methods)}"
            )
        self.fn, self.workers = fn, workers
        self._ctx = multiprocessing.get_context(start_method)
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.killed = 0  # workers killed at a timeout or found dead

    async def call(self, *args: Any) -> Any:
        """``fn(*args)`` in a worker process; raises the tool's error, or ``RuntimeError`` if the
        worker died; a cancellation (the ``ToolRunner`` timeout) kills the worker."""
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            starting = asyncio.ensure_future(on_daemon_thread(_Worker, (self._ctx,)))
            try:
                worker = await asyncio.shield(starting)
            except asyncio.CancelledError:  # timed out while it started: stop it once it has
                starting.add_done_callback(self._discard_started)
                raise
        try:
            ok, output = await on_daemon_thread(worker.run, (self.fn, args))
        except asyncio.CancelledError:
            self._discard(worker)
            raise
        except (EOFError, OSError) as e:
            self._discard(worker)
            raise RuntimeError(f"the tool's worker process died ({type(e).__name__})") from None
        except BaseException:  # e.g. arguments that do not pickle: the worker is still well
            self._return(worker)
            raise
        self._return(worker)
        if not ok:
            raise RuntimeError(output)
        return output

    def _discard_started(self, starting: asyncio.Future) -> None:
        if not starting.cancelled() and starting.exception() is None:
            self._discard(starting.result())

    def _return(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.workers:
                self._idle.append(worker)
                return
        worker.kill()

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self.killed += 1

    def close(self) -> None:
        with self._lock:
            self._closed = True  # a call still running stops its worker when it returns
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()
