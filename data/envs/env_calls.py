"""Environment methods off the episode loop, with timeouts, a per-episode deadline and one
fault contract (``docs/envs.md``, "Faults and the episode lifecycle").

Nothing user-written runs on the episode loop: ``EnvCalls.call("step", ...)`` runs
``env.step`` on a bounded pool of ``env.workers`` threads, each with an event loop of its own
(a coroutine method runs to completion there, its tool calls included), so a ``step`` that
blocks for seconds delays only its own episode. Each call waits at most ``env.call_timeout_s``
and at most what is left of the episode's ``env.episode_timeout_s`` (time spent in environment
calls, not in generation: a slow engine does not count against the environment).

A call that raises (any ``BaseException``: ``SystemExit`` from user code cannot kill a thread
the run depends on), times out or overruns the deadline is an ``EnvironmentFault`` naming the
environment, the method and the prompt. ``on_error`` decides what it does, as
``data.reward_errors`` does for reward functions:

* ``fail`` (default): the episode's future fails with it; the rollout re-raises it in the
  trainer's thread at once and the run stops with that one error (its last checkpoint resumes it).
* ``zero``: the episode scores 0, the error is recorded in its turn records (``env_error``,
  written to experiences.jsonl) and counted (``env/env_errors``, per method
  ``env/env_errors_<method>``; evaluation's under ``eval/``).

A blocking call that times out keeps its pool thread until it returns (Python cannot stop a
thread); a coroutine that times out is cancelled on its thread's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextvars
import inspect
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from data.envs.base import Step
from modules.config.errors import check_choice

ON_ERROR = ("fail", "zero")  # the values of data.reward_errors
METHODS = ("reset", "step", "final_reward", "cleanup")


class EnvironmentFault(RuntimeError):
    """An environment method raised, timed out or overran the episode's deadline."""

    def __init__(self, env: str, method: str, row: dict | None, detail: str) -> None:
        where = f"prompt id {row.get('id')}" if isinstance(row, dict) else "an episode"
        super().__init__(f"environment {env} failed in {method} on {where}: {detail}")
        self.method = method
        self.detail = detail


@dataclass
class Deadline:
    """What is left of an episode's time in environment calls (None: no deadline)."""

    left_s: float | None

    def spend(self, seconds: float) -> None:
        if self.left_s is not None:
            self.left_s -= seconds


class EnvCalls:
    def __init__(self, env: Any, on_error: str = "fail") -> None:
        check_choice("data.reward_errors", on_error, ON_ERROR)
        self.env = env
        self.on_error = on_error
        self.pool = _DaemonPool(env.workers)
        self.errors: dict[str, Counter] = {"train": Counter(), "eval": Counter()}
        self._lock = threading.Lock()
        self._local = threading.local()  # each pool thread's own event loop

    async def call(
        self,
        method: str,
        row: dict | None,
        deadline: Deadline,
        *args: Any,
        abandoned: Callable[[Any], None] | None = None,
    ) -> Any:
        """``env.<method>(*args)`` on the pool; raises ``EnvironmentFault``. The timeout counts
        from when the call starts running (not its wait for a free thread). If the caller is
        cancelled, the call is cancelled too (a coroutine) and waited for, bounded, so that a
        ``cleanup`` after it never races it; ``abandoned(result)`` gets what a call returns after
        its caller stopped waiting (a ``reset`` whose episode was cancelled: its state to clean)."""
        timeout = self.env.call_timeout_s
        if deadline.left_s is not None:
            if deadline.left_s <= 0:
                raise self.fault(method, row, f"env.episode_timeout_s={self.env.episode_timeout_s:g} s spent")
            timeout = min(timeout, deadline.left_s)
        running: dict[str, Any] = {}
        context = contextvars.copy_context()  # the phase (train / eval) reaches the tools' counters
        started, fut = self.pool.submit(context.run, self._run, getattr(self.env, method), args, running)
        waiting = asyncio.wrap_future(fut)
        t0 = None
        wait_s = self.env.episode_timeout_s or 10 * self.env.call_timeout_s
        try:
            try:  # a free thread: every worker hung would otherwise stall the episode
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(started)), wait_s)
            except asyncio.TimeoutError:
                self._abandon(fut, running, abandoned)
                detail = f"no free thread within {wait_s:g} s (env.workers={self.env.workers}, all busy)"
                raise self.fault(method, row, detail) from None
            t0 = time.monotonic()
            return await asyncio.wait_for(asyncio.shield(waiting), timeout)
        except asyncio.TimeoutError:
            self._abandon(fut, running, abandoned)
            raise self.fault(method, row, f"timed out after {timeout:g} s") from None
        except asyncio.CancelledError:
            self._abandon(fut, running, abandoned)
            await asyncio.shield(_settled(waiting, self.env.call_timeout_s))  # never race a cleanup
            raise
        except _UserError as e:
            raise self.fault(method, row, e.text) from e.__cause__
        finally:
            if t0 is not None:
                deadline.spend(time.monotonic() - t0)

    def _abandon(
        self, fut: cf.Future, running: dict[str, Any], abandoned: Callable[[Any], None] | None
    ) -> None:
        """Stop a call nobody waits for: cancel it if queued or a coroutine; hand a result that
        still arrives to ``abandoned``."""
        fut.cancel()
        loop, task = running.get("loop"), running.get("task")
        if abandoned is None and loop is not None and task is not None and not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)  # (a reset runs on: what it makes is cleaned up)
        if abandoned is not None:
            fut.add_done_callback(
                lambda f: abandoned(f.result()) if not f.cancelled() and not f.exception() else None
            )

    def fault(self, method: str, row: dict | None, detail: str) -> EnvironmentFault:
        return EnvironmentFault(type(self.env).__name__, method, row, detail)

    def count(self, phase: str, method: str) -> None:
        with self._lock:
            self.errors.setdefault(phase, Counter())[method] += 1

    def take_stats(self, phase: str = "train") -> dict[str, float]:
        """Environment errors since the last call, in total and per method."""
        with self._lock:
            counts, self.errors[phase] = self.errors.get(phase, Counter()), Counter()
        out = {"env/env_errors": float(sum(counts.values()))}
        out.update({f"env/env_errors_{m}": float(counts[m]) for m in METHODS if counts[m]})
        return out

    def spawn(self, method: str, *args: Any) -> cf.Future:
        """``env.<method>(*args)`` on the pool, not waited for here (its future)."""
        return self.pool.submit(self._run, getattr(self.env, method), args, {})[1]

    def run_sync(self, method: str, row: dict | None, timeout_s: float, *args: Any) -> None:
        """``env.<method>(*args)`` from a thread outside any loop (teardown), bounded."""
        fut = self.spawn(method, *args)
        try:
            fut.result(timeout=timeout_s)
        except cf.TimeoutError as e:
            raise self.fault(method, row, f"timed out after {timeout_s:g} s") from e
        except _UserError as e:
            raise self.fault(method, row, e.text) from e.__cause__

    def _run(self, fn: Callable[..., Any], args: tuple, running: dict[str, Any]) -> Any:
        """On a pool thread: call ``fn``; a coroutine runs on this thread's own loop."""
        try:
            result = fn(*args)
            if inspect.isawaitable(result):
                loop = getattr(self._local, "loop", None)
                if loop is None:
                    loop = self._local.loop = asyncio.new_event_loop()
                task = loop.create_task(_awaited(result))
                running.update(loop=loop, task=task)
                result = loop.run_until_complete(task)
            return result
        except asyncio.CancelledError:
            raise _UserError("cancelled") from None
        except BaseException as e:  # noqa: BLE001 - SystemExit included: the pool thread lives on
            raise _UserError(f"{type(e).__name__}: {e}") from e

    def close(self, timeout_s: float = 5.0) -> None:
        """Let the calls running now finish (bounded); the threads are daemons either way."""
        self.pool.close(timeout_s)


class _DaemonPool:
    """``workers`` daemon threads (a hung call never keeps the process alive, unlike
    ``ThreadPoolExecutor``'s); ``submit`` returns (started, done) futures."""

    def __init__(self, workers: int) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"asyncrl-env-call-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> tuple[cf.Future, cf.Future]:
        started, done = cf.Future(), cf.Future()
        self._queue.put((started, done, fn, args))
        return started, done

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            started, done, fn, args = job
            if not done.set_running_or_notify_cancel():
                started.cancel()
                continue
            started.set_result(None)
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)

    def close(self, timeout_s: float) -> None:
        for _ in self._threads:
            self._queue.put(None)
        end = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))


async def _settled(fut: asyncio.Future, timeout_s: float) -> None:
    """Wait for ``fut`` to finish, at most ``timeout_s``, whatever it ends with."""
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout_s)
    except BaseException:  # noqa: BLE001 - only its end matters here
        pass


class _UserError(Exception):
    """A user method's exception, as text (its own type may be a BaseException)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def finite_number(value: Any) -> float | None:
    """``value`` as a finite float, or None."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def bad_step(step: Any) -> str | None:
    """What is wrong with what ``step`` returned, or None."""
    if not isinstance(step, Step):
        return f"returned {type(step).__name__}, not a Step"
    if finite_number(step.reward) is None:
        return f"returned Step(reward={step.reward!r}), not a finite number"
    if not isinstance(step.observation, str) or not isinstance(step.info, dict):
        return "returned a Step whose observation is not a str or whose info is not a dict"
    return None
