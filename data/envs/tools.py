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
import contextlib
import contextvars
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

from data.envs.threads import DaemonPool, ToolExit, describe
from modules.config.errors import check, is_count

# Whose counters a call goes to: training's or evaluation's episodes (set per episode).
PHASE: contextvars.ContextVar[str] = contextvars.ContextVar("asyncrl_tool_phase", default="train")

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
        # one limit for every thread and loop that runs calls (episodes' environment calls
        # run on loops of their own: data/envs/env_calls.py)
        self._slots = threading.BoundedSemaphore(concurrency)
        self._pool: DaemonPool | None = None  # started at the first plain-function call
        self._lock = threading.Lock()
        # per phase (train / eval, PHASE): calls, errors, timeouts, every call's wall time
        self._counts: dict[str, list] = {}

    @contextlib.asynccontextmanager
    async def _slot(self) -> Any:
        """One of ``concurrency`` places, waited for without blocking the loop."""
        while not self._slots.acquire(blocking=False):
            await asyncio.sleep(0.005)
        try:
            yield
        finally:
            self._slots.release()

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
        async with self._slot():
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
            counts = self._counts.setdefault(PHASE.get(), [0, 0, 0, []])
            counts[0] += 1
            counts[1] += not result.ok
            counts[2] += result.timed_out and not result.ok
            counts[3].append(result.seconds)
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

    def take_stats(self, phase: str = "train") -> dict[str, float]:
        """Counters and latency percentiles of ``phase``'s calls since the last call."""
        with self._lock:
            calls, errors, timeouts, secs = self._counts.pop(phase, [0, 0, 0, []])
            secs = sorted(secs)
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
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


def _retrieve(task: asyncio.Future) -> None:
    """Mark the outcome of an attempt nobody awaits any more as seen (no "never retrieved")."""
    if not task.cancelled():
        task.exception()


def is_async(fn: Callable[..., Any]) -> bool:
    """A coroutine function, also behind ``functools.partial``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn)
