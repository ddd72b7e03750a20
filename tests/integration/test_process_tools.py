"""CPU-bound tools in worker processes (data/envs/processes.py): a timeout stops them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from data.envs.processes import ProcessTool
from data.envs.tools import ToolRunner

# The tools below run in spawned workers, which import this module: it imports nothing heavy
# (a worker under ``memory_mb`` has to import it within its address space).


def children() -> set[int]:
    """This process's descendants, less multiprocessing's resource tracker (one per process,
    shared by every later spawn; not a tool worker)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "multiprocessing.resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def alive(pid: int) -> bool:
    """Running (a zombie that nobody reaped is dead: PID 1 here may not reap orphans)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


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


def spawn_and_hang(pidfile: str) -> int:
    """Starts a child (in the worker's process group) and hangs."""
    child = subprocess.Popen(["sleep", "45"])
    Path(pidfile).write_text(str(child.pid))
    time.sleep(60)
    return child.pid


def spawn_and_return() -> int:
    """Leaves a child running behind it (e.g. a server the tool started)."""
    return subprocess.Popen(["sleep", "45"]).pid


def hog() -> int:
    blocks = []
    while True:
        blocks.append(bytearray(32 << 20))  # touched: real memory, 32 MiB at a time


def test_a_timed_out_worker_takes_its_children_with_it(tmp_path):
    runner = ToolRunner(timeout_s=3.0)  # the worker's start (about 0.5 s) included
    tool = ProcessTool(spawn_and_hang, workers=1)
    pidfile = tmp_path / "child.pid"
    t0 = time.monotonic()
    try:
        result = asyncio.run(runner.call(tool.call, str(pidfile)))
        assert not result.ok and result.timed_out and time.monotonic() - t0 < 5.0, result
    finally:
        tool.close()
    sleeper = int(pidfile.read_text())
    try:
        assert wait_until(lambda: not alive(sleeper)), "the tool's child outlived its killed worker"
    finally:
        if alive(sleeper):
            os.kill(sleeper, 9)


def test_close_leaves_no_process_thread_or_shared_memory():
    shm = set(os.listdir("/dev/shm"))
    threads, before = threading.active_count(), children()
    tool = ProcessTool(spawn_and_return, workers=2)

    async def calls():
        return await asyncio.gather(tool.call(), tool.call())

    try:
        sleepers = asyncio.run(calls())
        assert all(alive(p) for p in sleepers) and len(children() - before) >= 2
    finally:
        tool.close()
    try:
        assert wait_until(lambda: not any(alive(p) for p in sleepers)), "a tool's child outlived close()"
        assert wait_until(lambda: not (children() - before)), children() - before
        assert wait_until(lambda: threading.active_count() <= threads), threading.enumerate()
        assert set(os.listdir("/dev/shm")) <= shm
    finally:
        for p in sleepers:
            if alive(p):
                os.kill(p, 9)


def test_a_memory_hog_under_memory_mb_is_a_tool_error_and_the_next_call_a_fresh_worker():
    runner = ToolRunner(timeout_s=20.0)
    tool = ProcessTool(hog, workers=1, memory_mb=512)
    fine = ProcessTool(spin, workers=1, memory_mb=512)

    async def calls():
        t0 = time.monotonic()
        result = await runner.call(tool.call)
        return result, time.monotonic() - t0, await runner.call(fine.call, 0.0)

    try:
        result, waited, after = asyncio.run(calls())
    finally:
        tool.close()
        fine.close()
    assert not result.ok and not result.timed_out and "MemoryError" in result.output and waited < 8.0, (
        result,
        waited,
    )
    assert tool.killed == 1 and not tool._idle  # retired: the next call starts a fresh worker
    assert after.ok  # a tool within the limit runs under it


def test_a_tool_over_cpu_s_is_a_tool_error_within_seconds():
    runner = ToolRunner(timeout_s=20.0)
    tool = ProcessTool(spin, workers=1, cpu_s=1.0)

    async def calls():
        t0 = time.monotonic()
        quick = await runner.call(tool.call, 0.3)  # each call gets cpu_s of its own
        again = await runner.call(tool.call, 0.8)
        return quick, again, await runner.call(tool.call, 30.0), time.monotonic() - t0

    try:
        quick, again, over, waited = asyncio.run(calls())
    finally:
        tool.close()
    assert quick.ok and again.ok and quick.output == again.output  # one worker, 1.1 s of CPU
    assert not over.ok and not over.timed_out and "SIGXCPU" in over.output and waited < 10.0, (over, waited)


def test_bad_limits_are_refused_at_construction():
    for field, bad in (
        ("memory_mb", 0),
        ("memory_mb", 1.5),
        ("memory_mb", True),
        ("cpu_s", 0),
        ("cpu_s", float("nan")),
    ):
        with pytest.raises(ValueError, match=field):
            ProcessTool(square, **{field: bad})


def exits(code: int) -> int:
    raise SystemExit(code)


def test_a_tool_that_exits_is_a_tool_error_and_its_worker_serves_on():
    runner = ToolRunner(timeout_s=20.0)
    tool = ProcessTool(exits, workers=1)

    async def calls():
        return await runner.call(tool.call, 3), await runner.call(tool.call, 4)

    try:
        first, second = asyncio.run(calls())
    finally:
        tool.close()
    assert not first.ok and "SystemExit: 3" in first.output and "SystemExit: 4" in second.output
    assert tool.killed == 0  # the worker caught it and served the second call
