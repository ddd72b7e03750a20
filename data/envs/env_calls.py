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
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
        self.pool = cf.ThreadPoolExecutor(max_workers=env.workers, thread_name_prefix="asyncrl-env-call")
        self.errors: dict[str, Counter] = {"train": Counter(), "eval": Counter()}
        self._lock = threading.Lock()
        self._local = threading.local()  # each pool thread's own event loop

    async def call(self, method: str, row: dict | None, deadline: Deadline, *args: Any) -> Any:
        """``env.<method>(*args)`` on the pool; raises ``EnvironmentFault``."""
        timeout = self.env.call_timeout_s
        if deadline.left_s is not None:
            if deadline.left_s <= 0:
                raise self.fault(method, row, f"env.episode_timeout_s={self.env.episode_timeout_s:g} s spent")
            timeout = min(timeout, deadline.left_s)
        running: dict[str, Any] = {}
        context = contextvars.copy_context()  # the phase (train / eval) reaches the tools' counters
        fut = self.pool.submit(context.run, self._run, getattr(self.env, method), args, running)
        t0 = time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except asyncio.TimeoutError:
            self._cancel(running)
            raise self.fault(method, row, f"timed out after {timeout:g} s") from None
        except _UserError as e:
            raise self.fault(method, row, e.text) from e.__cause__
        finally:
            deadline.spend(time.monotonic() - t0)

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

    def run_sync(self, method: str, row: dict | None, timeout_s: float, *args: Any) -> None:
        """``env.<method>(*args)`` from a thread outside any loop (teardown), bounded."""
        fut = self.pool.submit(self._run, getattr(self.env, method), args, {})
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
            raise _UserError("cancelled at its timeout") from None
        except BaseException as e:  # noqa: BLE001 - SystemExit included: the pool thread lives on
            raise _UserError(f"{type(e).__name__}: {e}") from e

    @staticmethod
    def _cancel(running: dict[str, Any]) -> None:
        loop, task = running.get("loop"), running.get("task")
        if loop is not None and task is not None and not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class _UserError(Exception):
    """A user method's exception, as text (its own type may be a BaseException)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
