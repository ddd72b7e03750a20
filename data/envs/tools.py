"""Tool calls of multi-turn environments: off the engine's loop, bounded, never fatal.

``ToolRunner.call(fn, *args)`` runs a tool (a plain function on a pool of at most ``threads``
daemon threads, or a coroutine function on the episode loop) with:

* a concurrency limit (``concurrency`` calls at once across all episodes; the rest queue),
* a timeout per attempt (``timeout_s``) and ``retries`` further attempts after a failure (at
  most 10), all within the call's deadline (``deadline_s``, from when the call gets its slot;
  default ``timeout_s * (retries + 1)`` plus the modelled latency): once it passes the call
  ends as a timeout, attempts left or not,
* a latency model (``latency``: ``Fixed``, ``LogNormal`` or ``Trace``), added before each
  attempt, so that experiments can give tools a heavy tail without a slow tool,

and returns a ``ToolResult``: the output, or the error as text with ``ok=False`` after the
last attempt. A tool that raises or hangs becomes an observation and a counter in the turn
record (``tool_errors``, ``tool_timeouts``), never a crash or a hang of the rollout. That holds
for any ``BaseException`` (``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``, a
``CancelledError`` of the tool's own): only a cancellation of the awaiting call propagates.

A plain function that hangs keeps its pool thread until it returns (Python cannot kill a
thread); the pool never grows past ``threads`` (default ``concurrency``), so while every thread
is held, later calls wait for one within their own timeout and time out. The threads are
daemons: a hung tool never blocks the process's exit. A retry runs the tool again, so retries
suit idempotent tools. A tool served over HTTP is a coroutine function that posts to it, with
request batching (``http.py``); a CPU-bound one runs in a killable process (``processes.py``).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules.config.errors import check, is_count

MAX_RETRIES = 10


class Latency:
    """Seconds a tool call waits before it runs (a model of the tool's own latency)."""

    def sample(self, rng: random.Random) -> float:
        return 0.0


class Fixed(Latency):
    def __init__(self, seconds: float = 0.0) -> None:
        check("env.tools.latency.seconds", seconds, math.isfinite(seconds) and seconds >= 0, "a float >= 0")
        self.seconds = float(seconds)

    def sample(self, rng: random.Random) -> float:
        return self.seconds


class LogNormal(Latency):
    """exp(N(log(median), sigma^2)) seconds, capped at ``cap_s``: median ``median_s``, a tail
    that grows with ``sigma`` (sigma = 1: the 99th percentile is 10x the median)."""

    def __init__(self, median_s: float = 0.05, sigma: float = 1.0, cap_s: float = 30.0) -> None:
        check("env.tools.latency.median_s", median_s, math.isfinite(median_s) and median_s > 0, "a float > 0")
        check("env.tools.latency.sigma", sigma, math.isfinite(sigma) and sigma >= 0, "a float >= 0")
        check("env.tools.latency.cap_s", cap_s, cap_s > 0, "a float > 0")
        self.median_s, self.sigma, self.cap_s = float(median_s), float(sigma), float(cap_s)

    def sample(self, rng: random.Random) -> float:
        return min(self.cap_s, self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)))


class Trace(Latency):
    """Latencies drawn (with replacement) from a measured trace: a text file of seconds, one
    per line."""

    def __init__(self, path: str) -> None:
        file = Path(path)
        check("env.tools.latency.path", path, file.is_file(), "an existing file of seconds, one per line")
        values = [float(x) for x in file.read_text().split()]
        check(
            "env.tools.latency.path",
            path,
            bool(values) and all(math.isfinite(v) and v >= 0 for v in values),
            "a file of finite seconds >= 0, at least one",
        )
        self.values = values

    def sample(self, rng: random.Random) -> float:
        return rng.choice(self.values)


@dataclass
class ToolResult:
    ok: bool
    output: Any = None  # the tool's return value (ok) or the error's text
    attempts: int = 1
    seconds: float = 0.0  # wall time of the call, queueing and modelled latency included
    timed_out: bool = False


class ToolRunner:
    def __init__(
        self,
        concurrency: int = 16,
        timeout_s: float = 10.0,
        retries: int = 0,
        latency: Latency | None = None,
        seed: int = 0,
        threads: int | None = None,
        deadline_s: float | None = None,
    ) -> None:
        check("env.tools.concurrency", concurrency, is_count(concurrency), "an int >= 1")
        check("env.tools.timeout_s", timeout_s, math.isfinite(timeout_s) and timeout_s > 0, "a float > 0")
        check(
            "env.tools.retries",
            retries,
            isinstance(retries, int) and not isinstance(retries, bool) and 0 <= retries <= MAX_RETRIES,
            f"an int in [0, {MAX_RETRIES}]",
        )
        check(
            "env.tools.threads",
            threads,
            threads is None or is_count(threads),
            "null (concurrency) or an int >= 1",
        )
        check(
            "env.tools.deadline_s",
            deadline_s,
            deadline_s is None
            or (isinstance(deadline_s, (int, float)) and math.isfinite(deadline_s) and deadline_s > 0),
            "null (timeout_s * (retries + 1) plus the modelled latency) or a float > 0",
        )
        self.concurrency = concurrency
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.threads = threads if threads is not None else concurrency
        self.deadline_s = float(deadline_s) if deadline_s is not None else None
        self.latency = latency if latency is not None else Latency()
        self._rng = random.Random(seed)
        self._sems: dict[int, asyncio.Semaphore] = {}  # one per event loop that runs calls
        self._pool: DaemonPool | None = None  # started at the first plain-function call
        self._lock = threading.Lock()
        self.calls = self.errors = self.timeouts = 0
        self.seconds: list[float] = []  # every call's wall time (percentiles in the metrics)

    def _semaphore(self) -> asyncio.Semaphore:
        """The concurrency limit of the running loop (a semaphore belongs to one loop)."""
        loop = id(asyncio.get_running_loop())
        with self._lock:
            if loop not in self._sems:
                self._sems = {loop: asyncio.Semaphore(self.concurrency)}  # the old loop is gone
            return self._sems[loop]

    def _threads(self) -> DaemonPool:
        with self._lock:
            if self._pool is None:
                self._pool = DaemonPool(self.threads)
            return self._pool

    async def call(self, fn: Callable[..., Any], *args: Any) -> ToolResult:
        """Run ``fn(*args)`` as described above; never raises (but lets a cancellation of the
        awaiting call through)."""
        t0 = time.monotonic()
        result = ToolResult(ok=False)
        async with self._semaphore():
            start = time.monotonic()
            deadline = start + (self.deadline_s or 0.0)
            for attempt in range(1, self.retries + 2):
                with self._lock:
                    delay = self.latency.sample(self._rng)
                if self.deadline_s is None:  # each attempt brings its timeout and latency
                    deadline += self.timeout_s + delay
                left = deadline - time.monotonic()
                # the deadline, not the timeout, bounds this attempt (by default never but a hair)
                cut = self.deadline_s is not None and left < self.timeout_s + delay
                if left > 0:
                    result.attempts = attempt
                    limit = min(self.timeout_s + delay, left)
                    result.ok, result.timed_out, result.output = await self._attempt(fn, args, delay, limit)
                if left <= 0 or (cut and result.timed_out):  # attempts may remain, time does not
                    result.timed_out = True
                    result.output = f"tool timed out: the call's deadline of {deadline - start:g} s passed"
                    break
                if result.ok:
                    break
        result.seconds = time.monotonic() - t0
        with self._lock:
            self.calls += 1
            self.errors += not result.ok
            self.timeouts += result.timed_out and not result.ok
            self.seconds.append(result.seconds)
        return result

    async def _attempt(self, fn: Callable[..., Any], args: tuple, delay: float, limit: float) -> tuple:
        """(ok, timed out, output or error text) of one attempt of at most ``limit`` seconds.
        The attempt is a task of its own: what the tool raises is its result, never this
        call's exception, and a tool that ignores its cancellation is left behind, not awaited."""
        task = asyncio.ensure_future(self._run(fn, args, delay))
        try:
            await asyncio.wait({task}, timeout=limit)
            if not task.done():
                task.cancel()
                task.add_done_callback(_retrieve)
                await asyncio.wait({task}, timeout=0.05)  # a pool job dequeued, a worker killed
                return False, True, f"tool timed out after {self.timeout_s:g} s"
        except asyncio.CancelledError:  # the awaiting call was cancelled: the one thing that propagates
            task.cancel()
            task.add_done_callback(_retrieve)
            raise
        if task.cancelled():  # not by us: a CancelledError of the tool's own
            return False, False, f"tool error: {describe(ToolExit(fn, asyncio.CancelledError()))}"
        error = task.exception()
        if error is not None:
            return False, False, f"tool error: {describe(error)}"
        return True, False, task.result()

    async def _run(self, fn: Callable[..., Any], args: tuple, delay: float) -> Any:
        if delay > 0:
            await asyncio.sleep(delay)
        if not is_async(fn):
            return await self._threads().run(fn, args)
        try:
            return await fn(*args)
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException as e:  # noqa: BLE001 - SystemExit etc. would stop the loop
            raise ToolExit(fn, e) from None

    def take_stats(self) -> dict[str, float]:
        """Counters and latency percentiles since the last call (for the step's metrics)."""
        with self._lock:
            secs, self.seconds = sorted(self.seconds), []
            calls, errors, timeouts = self.calls, self.errors, self.timeouts
            self.calls = self.errors = self.timeouts = 0
        out = {
            "env/tool_calls": float(calls),
            "env/tool_errors": float(errors),
            "env/tool_timeouts": float(timeouts),
        }
        for q in (50, 90, 99):
            if secs:
                out[f"env/tool_latency_p{q}_s"] = secs[min(len(secs) - 1, int(q / 100 * len(secs)))]
        return out

    def close(self) -> None:
        """Idle pool threads exit (a hung one when its tool returns); a later call starts anew."""
        with self._lock:
            self._sems = {}
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


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


def _retrieve(task: asyncio.Future) -> None:
    """Mark the outcome of an attempt nobody awaits any more as seen (no "never retrieved")."""
    if not task.cancelled():
        task.exception()


def is_async(fn: Callable[..., Any]) -> bool:
    """A coroutine function, also behind ``functools.partial``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn)


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
