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


async def _stubborn() -> None:
    """A request that ignores cancellation."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            continue


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

    thread.run(_stubborn())
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


def test_a_second_stop_during_the_drain_still_closes_the_loop():
    thread = _started(drain_s=30)

    thread.run(_stubborn())
    time.sleep(0.1)
    thread.stop(timeout_s=0.2)  # the loop stops and starts draining; the join gives up
    assert thread.alive
    t0 = time.monotonic()
    thread.stop(timeout_s=5)  # a second stop (a shutdown called twice) lands in the drain
    assert time.monotonic() - t0 < 3
    assert not thread.alive
    assert thread._loop is not None and thread._loop.is_closed()
    assert thread.error is None


def test_a_loop_that_died_keeps_its_error_for_the_health_check():
    thread = _started()

    async def in_flight() -> None:
        await asyncio.sleep(3600)

    future = thread.run(in_flight())
    time.sleep(0.1)  # the request is in flight when the loop dies

    def die() -> None:
        raise SystemExit(3)  # escapes run_forever, as a fatal error in a callback would

    thread._loop.call_soon_threadsafe(die)
    thread._thread.join(timeout=5)
    assert not thread.alive
    assert isinstance(thread.error, SystemExit)  # check_health names it; the caller is not told "cancelled"
    assert not future.cancelled()
