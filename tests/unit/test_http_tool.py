"""Tools served over HTTP (data/envs/http.py): a real local server, batched requests, errors
as observations."""

from __future__ import annotations

import asyncio

import pytest

from data.envs.calculator_env import calculate
from data.envs.http import HttpTool, serve
from data.envs.tools import ToolRunner


@pytest.fixture
def server():
    s = serve(calculate)
    yield s
    s.stop()


def test_concurrent_calls_go_out_in_batches_and_come_back_in_order(server):
    tool = HttpTool(server.url, batch_size=16, max_wait_s=0.05)
    runner = ToolRunner(concurrency=64)
    exprs = [f"{a}*{a + 1}" for a in range(40)]

    async def all_calls():
        return await asyncio.gather(*(runner.call(tool.call, x) for x in exprs))

    results = asyncio.run(all_calls())
    assert [r.output for r in results] == [a * (a + 1) for a in range(40)] and all(r.ok for r in results)
    assert sum(server.batches) == 40 and max(server.batches) <= 16
    assert tool.requests == len(server.batches) <= 5  # 40 calls, a handful of requests


def test_a_server_error_is_a_tool_error_not_a_crash(server):
    tool = HttpTool(server.url, max_wait_s=0.0)
    runner = ToolRunner(retries=1)

    async def one():
        return await runner.call(tool.call, "4**2")  # the server's calculate() raises

    result = asyncio.run(one())
    assert not result.ok and result.attempts == 2 and "500" in result.output
    assert runner.take_stats()["env/tool_errors"] == 1


def test_a_dead_server_times_out_or_fails_fast():
    runner = ToolRunner(timeout_s=2.0)
    tool = HttpTool("http://127.0.0.1:9/", max_wait_s=0.0)  # nothing listens on port 9

    async def one():
        return await runner.call(tool.call, "1+1")

    result = asyncio.run(one())
    assert not result.ok and result.seconds < 3.0


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="url"):
        HttpTool("localhost:8000")
    with pytest.raises(Exception, match="env.http.batch_size"):
        HttpTool("http://x/", batch_size=0)


def test_the_calculator_environment_over_http():
    from data.envs.calculator_env import CalculatorEnv

    env = CalculatorEnv(http={"batch_size": 8})
    row = {"id": 0, "prompt": "47*38?", "answer": "1786", "level": 2}

    async def episode():
        state = await env.reset(row)
        return await env.step(state, "c47*38=")

    try:
        step = asyncio.run(episode())
        assert step.observation == "1786;" and env.server.batches == [1]
    finally:
        env.close()
