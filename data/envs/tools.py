"""Tool calls of multi-turn environments: off the engine's loop, bounded, never fatal.

``ToolRunner.call(fn, *args)`` runs a tool (a plain function on a daemon thread of its own, or a
coroutine function on the episode loop) with:

* a concurrency limit (``concurrency`` calls at once across all episodes; the rest queue),
* a timeout per attempt (``timeout_s``) and ``retries`` further attempts after a failure,
* a latency model (``latency``: ``Fixed``, ``LogNormal`` or ``Trace``), added before each
  attempt, so that experiments can give tools a heavy tail without a slow tool,

and returns a ``ToolResult``: the output, or the error as text with ``ok=False`` after the
last attempt. A tool that raises or hangs becomes an observation and a counter in the turn
record (``tool_errors``, ``tool_timeouts``), never a crash or a hang of the rollout.

A plain function that hangs keeps its thread (Python cannot kill a thread) but not the
rollout or the process's exit: the call times out and the thread is a daemon. A retry runs the
tool again, so retries suit idempotent tools. A tool served over HTTP is a coroutine function
that posts to it, with request batching (``http.py``).
"""

from __future__ import annotations

import asyncio
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

from modules.config.errors import check


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
    ) -> None:
        check(
            "env.tools.concurrency",
            concurrency,
            isinstance(concurrency, int) and concurrency >= 1,
            "an int >= 1",
        )
        check("env.tools.timeout_s", timeout_s, math.isfinite(timeout_s) and timeout_s > 0, "a float > 0")
        check("env.tools.retries", retries, isinstance(retries, int) and retries >= 0, "an int >= 0")
        self.concurrency = concurrency
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.latency = latency if latency is not None else Latency()
        self._rng = random.Random(seed)
        self._sems: dict[int, asyncio.Semaphore] = {}  # one per event loop that runs calls
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

    async def call(self, fn: Callable[..., Any], *args: Any) -> ToolResult:
        """Run ``fn(*args)`` as described above; never raises (but lets a cancellation through)."""
        t0 = time.monotonic()
        result = ToolResult(ok=False)
        async with self._semaphore():
            for attempt in range(1, self.retries + 2):
                result.attempts = attempt
                with self._lock:
                    delay = self.latency.sample(self._rng)
                try:
                    output = await asyncio.wait_for(self._attempt(fn, args, delay), self.timeout_s + delay)
                    result.ok, result.output, result.timed_out = True, output, False
                    break
                except asyncio.TimeoutError:
                    result.timed_out = True
                    result.output = f"tool timed out after {self.timeout_s:g} s"
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - a tool's failure is an observation
                    result.timed_out = False
                    result.output = f"tool error: {type(e).__name__}: {e}"
        result.seconds = time.monotonic() - t0
        with self._lock:
            self.calls += 1
            self.errors += not result.ok
            self.timeouts += result.timed_out and not result.ok
            self.seconds.append(result.seconds)
        return result

    async def _attempt(self, fn: Callable[..., Any], args: tuple, delay: float) -> Any:
        if delay > 0:
            await asyncio.sleep(delay)
        if is_async(fn):
            return await fn(*args)
        return await on_daemon_thread(fn, args)

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
        with self._lock:
            self._sems = {}


def is_async(fn: Callable[..., Any]) -> bool:
    """A coroutine function, also behind ``functools.partial``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn)


async def on_daemon_thread(fn: Callable[..., Any], args: tuple) -> Any:
    """``fn(*args)`` on a new daemon thread: one that hangs outlives its timeout but neither
    blocks a pool of later calls nor the process's exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def run() -> None:
        value, error = None, None
        try:
            value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting call
            error = e
        try:
            loop.call_soon_threadsafe(_settle, fut, value, error)
        except RuntimeError:  # the loop closed meanwhile (the run ended): nobody waits
            pass

    threading.Thread(target=run, name="asyncrl-tool", daemon=True).start()
    return await fut


def _settle(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if fut.done():  # timed out or cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
