"""Threads of the vLLM engine: its asyncio event loop, and the thread completion callbacks run on.

``LoopThread``: a daemon thread that runs its own asyncio event loop, for an async engine
driven from sync code.

The trainer thread never touches asyncio: it hands coroutines to ``run`` (thread-safe) and
waits on the returned ``concurrent.futures.Future``. ``start`` runs a build coroutine first
and returns once it finished; an error raised by the build or by the loop later is kept in
``error`` for the owner's health check.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import queue
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from modules.engine.types import EngineError


class LoopThread:
    def __init__(
        self, name: str, drain_s: float = 5.0, on_death: Callable[[BaseException], None] | None = None
    ) -> None:
        self.name = name
        self.on_death = on_death  # called (on this thread) if the loop dies of an error
        self.drain_s = drain_s  # how long tasks still pending at stop get to unwind (see _drain)
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, build: Callable[[], Coroutine[Any, Any, Any]], timeout_s: float) -> None:
        """Start the loop, run ``build()`` on it and wait for it; raises ``EngineError`` if it
        fails or takes longer than ``timeout_s`` (the caller then calls ``stop``)."""
        self._thread = threading.Thread(target=self._main, args=(build,), name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise EngineError(f"engine did not start within {timeout_s:.0f} s")
        if self.error is not None:
            raise EngineError(f"engine failed to start: {self.error!r}") from self.error

    def wait_built(self, timeout_s: float) -> None:
        """If ``start`` was interrupted, let the build finish so what it started can be stopped."""
        if self.alive and not self._ready.is_set():
            self._ready.wait(timeout_s)

    def _main(self, build: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(build())
        except BaseException as e:  # surfaced by start()
            self.error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        except BaseException as e:
            self.error = e
            if self.on_death is not None:
                self.on_death(e)  # e.g. fail the futures handed out: no caller waits on a dead loop
        finally:
            try:
                if self.error is None:  # a clean stop; a loop that died keeps its error for check_health
                    self._drain(loop)
            finally:
                loop.close()

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cancel the tasks still pending at a clean stop and give them ``drain_s`` to unwind: their
        ``finally`` blocks run and every future ``run`` handed out before the stop resolves
        (cancelled), so no caller waits forever on a request that was in flight at shutdown. A
        task that ignores the cancellation is left behind after ``drain_s``, and a second stop
        during the drain ends it early: the stop is bounded either way."""
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if not pending:
            return
        try:
            loop.run_until_complete(asyncio.wait(pending, timeout=self.drain_s))
        except RuntimeError:  # "Event loop stopped before Future completed": stopped again
            pass

    def run(self, coro: Coroutine[Any, Any, Any]) -> cf.Future:
        """Schedule ``coro`` on the loop from any thread."""
        assert self._loop is not None, "loop thread not started"
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def stop(self, timeout_s: float = 10.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=timeout_s)


class CallbackThread:
    """Runs completion callbacks (reward scoring, group assembly) in order on one daemon
    thread, off the engine's event loop: a slow reward must not stall vLLM's output handling,
    new submissions or weight-sync calls, which all run on that loop."""

    def __init__(self, name: str) -> None:
        self.error: BaseException | None = None  # the first callback that raised
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            try:
                fn(fut)
            except BaseException as e:  # surfaced by the engine's health check; keep serving
                self.error = self.error or e

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise EngineError(f"a completion callback failed: {self.error!r}") from self.error

    def on_done(self, fut: cf.Future, fn: Callable[[cf.Future], None]) -> None:
        """Call ``fn(fut)`` on this thread once ``fut`` is done."""
        fut.add_done_callback(lambda f: self._queue.put((fn, f)))

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop after the queued callbacks; a callback that hangs is left behind after
        ``timeout_s`` (a daemon thread: it cannot keep the process alive)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
