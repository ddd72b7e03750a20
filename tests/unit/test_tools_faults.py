"""Faults of tools (data/envs/tools.py): whatever a tool raises or however long it hangs, the
call ends as an observation and a counter within its deadline, on a bounded number of threads."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from data.envs.tools import Fixed, ToolRunner


def run_calls(*calls):
    """Run ``calls`` (coroutines) on one loop, then one more plain call on the same loop: a
    tool's exception that escaped a call, or stopped the loop, fails the test instead of
    stopping pytest (KeyboardInterrupt)."""

    async def main():
        results = [await c for c in calls]
        results.append(await ToolRunner().call(lambda: "alive"))
        return results

    try:
        results = asyncio.run(main())
    except BaseException as e:  # noqa: BLE001 - before the fix: SystemExit etc. escaped the loop
        raise AssertionError(f"a tool's {type(e).__name__} escaped the call: {e!r}") from None
    assert results[-1].ok and results[-1].output == "alive"  # the loop still runs calls
    return results[:-1]


def exits() -> int:
    raise SystemExit(3)


def interrupts() -> int:
    raise KeyboardInterrupt


def generator_exits() -> int:
    raise GeneratorExit


class Custom(BaseException):
    pass


def custom() -> int:
    raise Custom("odd")


async def async_exits() -> int:
    await asyncio.sleep(0)
    raise SystemExit(4)


async def async_interrupts() -> int:
    await asyncio.sleep(0)
    raise KeyboardInterrupt


async def async_cancels_itself() -> int:
    await asyncio.sleep(0)
    raise asyncio.CancelledError  # not a cancellation of the call: the tool's own error


@pytest.mark.parametrize(
    ("tool", "name"),
    [
        (exits, "SystemExit"),
        (interrupts, "KeyboardInterrupt"),
        (generator_exits, "GeneratorExit"),
        (custom, "Custom"),
        (async_exits, "SystemExit"),
        (async_interrupts, "KeyboardInterrupt"),
        (async_cancels_itself, "CancelledError"),
    ],
)
def test_a_base_exception_from_a_tool_is_a_tool_error_not_a_dead_loop(tool, name):
    runner = ToolRunner(timeout_s=2.0, retries=1)
    (result,) = run_calls(runner.call(tool))
    assert not result.ok and not result.timed_out and result.attempts == 2
    assert result.output.startswith(f"tool error: {name}") and tool.__name__ in result.output, result.output
    stats = runner.take_stats()
    assert stats["env/tool_calls"] == 1 and stats["env/tool_errors"] == 1 and stats["env/tool_timeouts"] == 0
    runner.close()


def test_a_cancellation_of_the_awaiting_call_still_propagates():
    release = threading.Event()
    runner = ToolRunner(timeout_s=5.0)

    async def main():
        task = asyncio.ensure_future(runner.call(release.wait, 5.0))
        await asyncio.sleep(0.1)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "finished"

    try:
        assert asyncio.run(main()) == "cancelled"
    finally:
        release.set()
        runner.close()


def tool_threads() -> int:
    return sum(t.name == "asyncrl-tool" for t in threading.enumerate())


def test_hanging_tools_hold_at_most_threads_threads_and_every_call_times_out():
    release = threading.Event()
    ran = []

    def hang() -> int:
        ran.append(1)
        release.wait(10)
        return 0

    runner = ToolRunner(concurrency=16, timeout_s=0.4, threads=2)
    before, peak = threading.active_count(), [0]

    async def main():
        async def watch():
            while True:
                peak[0] = max(peak[0], threading.active_count() - before)
                await asyncio.sleep(0.02)

        watcher = asyncio.ensure_future(watch())
        t0 = time.monotonic()
        results = await asyncio.gather(*(runner.call(hang) for _ in range(10)))
        watcher.cancel()
        return results, time.monotonic() - t0

    try:
        results, waited = asyncio.run(main())
        assert all(r.timed_out and not r.ok for r in results) and waited < 1.5, (results, waited)
        assert peak[0] <= 2 and threading.active_count() - before <= 2, peak
        assert len(ran) == 2  # the 8 calls that waited for a thread never ran, then or later
        assert runner.take_stats()["env/tool_timeouts"] == 10
    finally:
        release.set()
        runner.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:  # closed: they exit
        time.sleep(0.05)
    assert threading.active_count() <= before


def test_a_hanging_tool_does_not_leak_a_thread_per_call():
    """``threads`` defaults to ``concurrency``: one call after another, each timing out, leaves
    at most ``concurrency`` threads behind (before: one per call)."""
    release = threading.Event()
    runner = ToolRunner(concurrency=2, timeout_s=0.15)
    before = tool_threads()

    async def main():
        return await asyncio.gather(*(runner.call(release.wait, 10.0) for _ in range(10)))

    try:
        results = asyncio.run(main())
        assert all(r.timed_out for r in results)
        assert tool_threads() - before <= 2, tool_threads() - before
    finally:
        release.set()
        runner.close()


def test_a_free_thread_is_reused_and_results_come_back():
    runner = ToolRunner(concurrency=8, threads=2)

    async def main():
        return await asyncio.gather(*(runner.call(lambda i=i: (i, threading.get_ident())) for i in range(20)))

    results = asyncio.run(main())
    assert [r.output[0] for r in results] == list(range(20)) and all(r.ok for r in results)
    assert len({r.output[1] for r in results}) <= 2
    runner.close()


def test_retries_are_capped():
    ToolRunner(retries=10)
    for bad in (11, -1, True, 2.0):
        with pytest.raises(ValueError, match=r"env\.tools\.retries.*\[0, 10\]"):
            ToolRunner(retries=bad)


def test_bad_threads_and_deadline_name_their_field():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"env\.tools\.threads"):
            ToolRunner(threads=bad)
    for bad in (0, -1.0, float("nan"), float("inf"), "5"):
        with pytest.raises(ValueError, match=r"env\.tools\.deadline_s"):
            ToolRunner(deadline_s=bad)
    assert ToolRunner(concurrency=3).threads == 3 and ToolRunner(threads=5).threads == 5


def test_the_deadline_ends_a_hanging_call_although_attempts_remain():
    release = threading.Event()
    runner = ToolRunner(timeout_s=0.3, retries=10, deadline_s=0.8)
    t0 = time.monotonic()
    try:
        (result,) = run_calls(runner.call(release.wait, 10.0))
    finally:
        release.set()
    waited = time.monotonic() - t0
    assert not result.ok and result.timed_out and 0.7 < waited < 1.5, (result, waited)
    assert result.attempts <= 3 and "deadline" in result.output
    assert runner.take_stats()["env/tool_timeouts"] == 1
    runner.close()


def test_the_deadline_ends_a_failing_call_as_a_timeout():
    attempts = []

    def slow_failure() -> int:
        attempts.append(1)
        time.sleep(0.2)
        raise ValueError("flaky")

    runner = ToolRunner(timeout_s=5.0, retries=10, deadline_s=0.5)
    t0 = time.monotonic()
    (result,) = run_calls(runner.call(slow_failure))
    assert time.monotonic() - t0 < 1.0 and len(attempts) <= 3 and result.attempts == len(attempts)
    assert not result.ok and result.timed_out and "deadline" in result.output
    stats = runner.take_stats()
    assert stats["env/tool_errors"] == 1 and stats["env/tool_timeouts"] == 1
    runner.close()


def test_the_default_deadline_leaves_every_attempt_its_timeout_and_latency():
    runner = ToolRunner(timeout_s=0.2, retries=2, latency=Fixed(0.1))
    release = threading.Event()
    t0 = time.monotonic()
    try:
        (result,) = run_calls(runner.call(release.wait, 10.0))
    finally:
        release.set()
    assert result.timed_out and result.attempts == 3 and 0.85 < time.monotonic() - t0 < 1.5
    (quick,) = run_calls(runner.call(lambda: 7))
    assert quick.ok and quick.output == 7 and quick.attempts == 1
    runner.close()
