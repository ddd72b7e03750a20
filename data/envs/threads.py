"""Daemon threads for plain-function tools: a bounded pool (``DaemonPool``) whose threads a
hung tool may hold but never multiply, and ``on_daemon_thread`` for one-off blocking calls
(``processes.py`` waits on its workers with it). Daemon threads never block the process's exit.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import threading
from collections.abc import Callable
from typing import Any


class ToolExit(Exception):
    """A tool raised a ``BaseException`` that is not an ``Exception`` (``SystemExit``,
    ``KeyboardInterrupt``, ``GeneratorExit``, a ``CancelledError`` of its own), carried as an
    ``Exception``: it reaches the call as a tool error and cannot stop the event loop."""

    def __init__(self, fn: Callable[..., Any], error: BaseException) -> None:
        self.tool, self.error = tool_name(fn), error
        text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        super().__init__(f"{text} (raised by the tool {self.tool})")


def describe(error: BaseException) -> str:
    return str(error) if isinstance(error, ToolExit) else f"{type(error).__name__}: {error}"


def tool_name(fn: Callable[..., Any]) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class _Job:
    __slots__ = ("fn", "args", "loop", "fut")

    def __init__(self, fn: Callable[..., Any], args: tuple, loop: asyncio.AbstractEventLoop) -> None:
        self.fn, self.args, self.loop, self.fut = fn, args, loop, loop.create_future()

    def run(self) -> None:
        """On a thread: ``fn(*args)``, whatever it raises handed to the awaiting call."""
        value, error = None, None
        try:
            value = self.fn(*self.args)
        except Exception as e:  # noqa: BLE001 - handed to the awaiting call
            error = e
        except BaseException as e:  # noqa: BLE001 - as an Exception: it must not stop the loop
            error = ToolExit(self.fn, e)
        self.settle(value, error)

    def settle(self, value: Any, error: BaseException | None) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, self.fut, value, error)
        except RuntimeError:  # the loop closed meanwhile (the run ended): nobody waits
            pass


class DaemonPool:
    """At most ``size`` daemon threads for plain-function tools; a call waits (first come,
    first served) for a free one, and one cancelled while it waits never runs. A thread exits
    after ``idle_s`` without work or at ``close``; one whose tool hangs is held until it
    returns."""

    def __init__(self, size: int, idle_s: float = 30.0, name: str = "asyncrl-tool") -> None:
        self.size, self.idle_s, self.name = size, idle_s, name
        self._cond = threading.Condition()
        self._jobs: collections.deque[_Job] = collections.deque()
        self.live = 0  # threads alive
        self._waiting = 0  # idle threads waiting for a job
        self._closed = False

    async def run(self, fn: Callable[..., Any], args: tuple) -> Any:
        job = _Job(fn, args, asyncio.get_running_loop())
        with self._cond:
            if self._closed:
                raise RuntimeError("the tool runner is closed")
            self._jobs.append(job)
            if len(self._jobs) > self._waiting and self.live < self.size:
                self._start(job)
            self._cond.notify()
        try:
            return await job.fut
        except asyncio.CancelledError:  # timed out or cancelled: a job still waiting never runs
            with self._cond:
                if job in self._jobs:
                    self._jobs.remove(job)
            raise

    def _start(self, job: _Job) -> None:
        self.live += 1
        try:
            threading.Thread(target=self._work, name=self.name, daemon=True).start()
        except BaseException:
            self.live -= 1
            self._jobs.remove(job)
            raise

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    if self._closed:
                        self.live -= 1
                        return
                    self._waiting += 1
                    woken = self._cond.wait(self.idle_s)
                    self._waiting -= 1
                    if not woken and not self._jobs:
                        self.live -= 1
                        return
                job = self._jobs.popleft()
            job.run()
            del job  # not kept alive (its arguments, its output) while the thread waits

    def close(self) -> None:
        with self._cond:
            self._closed = True
            jobs, self._jobs = list(self._jobs), collections.deque()
            self._cond.notify_all()
        for job in jobs:
            job.settle(None, RuntimeError("the tool runner was closed"))


async def on_daemon_thread(fn: Callable[..., Any], args: tuple) -> Any:
    """``fn(*args)`` on a new daemon thread, for a call that ends when its own resource does
    (``processes.py``: a wait on a worker that a timeout kills); any ``BaseException`` comes
    back as an ``Exception``. Tools go through ``ToolRunner``'s bounded pool instead."""
    job = _Job(fn, args, asyncio.get_running_loop())
    threading.Thread(target=job.run, name="asyncrl-tool-wait", daemon=True).start()
    return await job.fut


def _settle(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if fut.done():  # timed out or cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
