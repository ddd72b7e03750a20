"""The engine's event-loop thread: a request in flight when the loop stops is cancelled and
unwinds (its ``finally`` runs, its future resolves), and a task that ignores the cancellation
cannot hang the stop."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import time

import pytest

from modules.engine.loop_thread import LoopThread


async def _built() -> None:
    return None


def _started(drain_s: float = 5.0) -> LoopThread:
    thread = LoopThread("test-loop", drain_s=drain_s)
    thread.start(_built, timeout_s=10)
    return thread


def test_a_request_in_flight_at_stop_is_cancelled_and_unwinds():
    thread = _started()
    cleaned = []

    async def in_flight() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append(True)

    future = thread.run(in_flight())
    time.sleep(0.1)
    thread.stop()
    assert cleaned == [True]  # its finally ran (e.g. the engine's busy counter is released)
    assert future.done() and future.cancelled()
    with pytest.raises(cf.CancelledError):
        future.result(timeout=0)
    assert not thread.alive


def test_a_task_that_ignores_cancellation_cannot_hang_the_stop():
    thread = _started(drain_s=0.2)

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue

    thread.run(stubborn())
    time.sleep(0.1)
    t0 = time.monotonic()
    thread.stop(timeout_s=5)
    assert time.monotonic() - t0 < 3
    assert not thread.alive


def test_finished_requests_keep_their_results():
    thread = _started()

    async def answer() -> int:
        return 42

    assert thread.run(answer()).result(timeout=5) == 42
    thread.stop()
    assert not thread.alive
