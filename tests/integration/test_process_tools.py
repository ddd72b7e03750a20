"""CPU-bound tools in worker processes (data/envs/processes.py): a timeout stops them."""

from __future__ import annotations

import asyncio
import os
import time

import psutil

from data.envs.processes import ProcessTool
from data.envs.tools import ToolRunner
from tests.integration.test_rewards import children  # descendants less the resource tracker


def square(x: int) -> int:
    return x * x


def spin(seconds: float) -> int:
    """CPU-bound, never yields: a thread running it could not be stopped."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return os.getpid()


def fail(x: int) -> int:
    raise ValueError(f"bad input {x}")


def test_a_spinning_tool_is_killed_at_its_timeout_and_the_next_call_gets_a_fresh_worker():
    runner = ToolRunner(concurrency=4, timeout_s=1.5, retries=0)
    tool = ProcessTool(spin, workers=2)

    async def calls():
        pid = await tool.call(0.0)  # a worker started and warm (spawn: imports this module)
        t0 = time.monotonic()
        hung = await runner.call(tool.call, 600.0)  # runs on that worker
        waited = time.monotonic() - t0
        return pid, hung, waited, await tool.call(0.0)

    try:
        pid, hung, waited, again = asyncio.run(calls())
    finally:
        tool.close()
    assert not hung.ok and hung.timed_out and waited < 3.0, (hung, waited)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and time.monotonic() < deadline:  # reaped on a thread
        time.sleep(0.1)
    assert tool.killed == 1 and not psutil.pid_exists(pid)  # killed and reaped
    assert again != pid  # a fresh worker


def test_results_errors_and_reuse():
    before = children()
    runner = ToolRunner(concurrency=4, timeout_s=30.0, retries=1)
    tool = ProcessTool(square, workers=1)
    bad = ProcessTool(fail, workers=1)

    async def calls():
        results = await asyncio.gather(*(runner.call(tool.call, i) for i in range(6)))
        return results, await runner.call(bad.call, 3)

    try:
        results, error = asyncio.run(calls())
        assert [r.output for r in results] == [i * i for i in range(6)] and all(r.ok for r in results)
        assert len(tool._idle) == 1 and tool.killed == 0  # one kept for reuse, the rest stopped
        assert not error.ok and error.attempts == 2 and "ValueError: bad input 3" in error.output
        assert bad.killed == 0  # a tool's exception is not a dead worker
    finally:
        tool.close()
        bad.close()
    deadline = time.monotonic() + 10
    while children() - before and time.monotonic() < deadline:  # killed; reaped on a thread
        time.sleep(0.1)
    assert children() <= before  # closed: no worker left
