"""Tools served over HTTP (data/envs/http.py): a real local server (uvicorn on a thread), batched
requests, per-item errors with the server's message, whole-request failures with status and
text, the failure threshold (``check_health``), the per-request timeout and the auth header."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from data.envs.calculator_env import calculate
from data.envs.http import HttpTool
from data.envs.http_server import serve
from data.envs.tools import ToolRunner


@pytest.fixture
def server():
    s = serve(calculate)
    yield s
    s.stop()


def closed_port_url() -> str:
    """A local URL where nothing listens (connection refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def asgi(status: int, body: bytes, content_type: bytes = b"application/json"):
    """A stand-in server that answers every request with ``status`` and ``body``."""

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]}
        )
        await send({"type": "http.response.body", "body": body})

    return app


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


def test_one_bad_input_fails_alone_with_the_servers_message(server):
    """Issue 53: 3 good inputs and 1 bad one in one request -> 3 outputs and 1 error carrying the
    server's message (the old server answered 500 for the whole batch, and its text was lost)."""
    tool = HttpTool(server.url, batch_size=16, max_wait_s=0.05)
    runner = ToolRunner(concurrency=8)
    exprs = ["2*3", "4**2", "5+5", "9-1"]

    async def all_calls():
        return await asyncio.gather(*(runner.call(tool.call, x) for x in exprs))

    results = asyncio.run(all_calls())
    assert server.batches == [4] and tool.requests == 1  # one request
    assert [r.output for r in results if r.ok] == [6, 10, 8]
    bad = results[1]
    assert not bad.ok and "ValueError: not a calculation: '4**2'" in bad.output and server.url in bad.output


def test_per_item_errors_are_remote_errors_and_do_not_count_as_failures(server):
    from data.envs.http import RemoteError

    tool = HttpTool(server.url, max_wait_s=0.05, max_consecutive_failures=1)

    async def all_calls():
        return await asyncio.gather(*(tool.call(x) for x in ["1+1", "oops"]), return_exceptions=True)

    ok, err = asyncio.run(all_calls())
    assert ok == 2 and isinstance(err, RemoteError) and "not a calculation: 'oops'" in str(err)
    assert tool.down is None  # the server answered: it is up
    tool.check_health()


def test_a_server_error_is_a_tool_error_not_a_crash(server):
    tool = HttpTool(server.url, max_wait_s=0.0)
    runner = ToolRunner(retries=1)

    async def one():
        return await runner.call(tool.call, "4**2")  # the server's calculate() raises

    result = asyncio.run(one())
    assert not result.ok and result.attempts == 2 and "not a calculation" in result.output
    assert runner.take_stats()["env/tool_errors"] == 1


def test_a_server_without_errors_in_its_answer_still_works():
    """Backward compatible: ``{"outputs": [...]}`` alone is a batch of successes."""
    from data.envs.http_server import serve_app

    s = serve_app(asgi(200, json.dumps({"outputs": [7]}).encode()))
    try:
        assert asyncio.run(HttpTool(s.url, max_wait_s=0.0).call("x")) == 7
    finally:
        s.stop()


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (503, b"queue full: retry in 30 s", ["HTTP 503", "queue full: retry in 30 s"]),
        (200, b"<html>proxy login</html>", ["not JSON", "proxy login"]),
        (200, b'{"outputs": [1]}', ["1 outputs for 3 inputs"]),
        (500, b"x" * 5000, ["HTTP 500", "x" * 400, "(5000 chars)"]),
    ],
)
def test_a_whole_request_failure_fails_every_call_with_status_and_text(status, body, expected):
    """Every call of the batch fails, each error carrying the status code and the server's text
    (the old client raised httpx's status error, which drops the body)."""
    from data.envs.http_server import serve_app

    s = serve_app(asgi(status, body))
    tool = HttpTool(s.url, max_wait_s=0.05)

    async def all_calls():
        return await asyncio.gather(*(tool.call(x) for x in "abc"), return_exceptions=True)

    try:
        errors = asyncio.run(all_calls())
    finally:
        s.stop()
    assert tool.requests == 1 and len(errors) == 3
    for e in errors:
        assert isinstance(e, Exception) and s.url in str(e) and all(x in str(e) for x in expected)
        assert len(str(e)) < 800  # truncated


def test_a_down_server_stops_the_run_after_max_consecutive_failures():
    """After ``max_consecutive_failures`` failed requests in a row the tool is down: calls raise
    at once, and ``check_health()`` (the episode runner's channel) raises naming the URL."""
    from data.envs.http import RemoteDownError

    url = closed_port_url()
    tool = HttpTool(url, max_wait_s=0.0, max_consecutive_failures=3)
    runner = ToolRunner(timeout_s=5.0)

    async def calls(n):
        return [await runner.call(tool.call, "1+1") for _ in range(n)]

    t0 = time.monotonic()
    results = asyncio.run(calls(2))
    assert not any(r.ok for r in results) and url in results[0].output and "connect" in results[0].output
    tool.check_health()  # 2 < 3: still up
    asyncio.run(calls(1))
    assert tool.down is not None and url in tool.down
    with pytest.raises(RemoteDownError, match=url) as info:
        tool.check_health()
    assert isinstance(info.value, RuntimeError) and "3 requests in a row" in str(info.value)
    later = asyncio.run(calls(2))  # refused at once, without a request
    assert tool.requests == 3 and all("RemoteDownError" in r.output for r in later)
    assert time.monotonic() - t0 < 5.0


def test_a_success_resets_the_count_and_zero_never_stops(server):
    tool = HttpTool(server.url, max_wait_s=0.0, max_consecutive_failures=2)
    tool.consecutive_failures = 1  # one failure behind it
    assert asyncio.run(tool.call("2*2")) == 4 and tool.consecutive_failures == 0
    never = HttpTool(closed_port_url(), max_wait_s=0.0, max_consecutive_failures=0)

    async def calls():
        for _ in range(5):
            with pytest.raises(Exception, match="connect"):
                await never.call("1+1")

    asyncio.run(calls())
    assert never.down is None and never.requests == 5
    never.check_health()


def test_a_slow_server_times_out_per_request_naming_it():
    """``timeout_s`` bounds each request (the tool runner's own timeout is longer)."""

    async def slow(x):
        await asyncio.sleep(30.0)
        return x

    s = serve(slow)
    tool = HttpTool(s.url, max_wait_s=0.0, timeout_s=0.5)
    runner = ToolRunner(timeout_s=10.0)

    async def calls():
        return [await runner.call(tool.call, "1+1") for _ in range(3)]

    try:
        results = asyncio.run(calls())
    finally:
        s.stop()
    for r in results:
        assert not r.ok and s.url in r.output and "no answer within env.http.timeout_s=0.5 s" in r.output
    # after the first call (which makes the client): within timeout_s + 1 s, the faster of two
    # (a busy shared machine can stall one), and none near the server's 30 s
    seconds = [r.seconds for r in results]
    assert min(seconds[1:]) < 0.5 + 1.0 and max(seconds) < 0.5 + 3.0, seconds


def test_the_auth_header_comes_from_an_environment_variable(server, monkeypatch):
    from modules.config.errors import ConfigError

    monkeypatch.setenv("ASYNCRL_TEST_TOOL_KEY", "s3cret-value")
    tool = HttpTool(server.url, max_wait_s=0.0, auth_env="ASYNCRL_TEST_TOOL_KEY")
    assert asyncio.run(tool.call("6*7")) == 42
    assert server.authorization == ["Bearer s3cret-value"]
    assert "s3cret" not in repr(tool) and "s3cret" not in str(vars(tool))
    for value in ("", None):  # empty, then missing
        if value is None:
            monkeypatch.delenv("ASYNCRL_TEST_TOOL_KEY")
        else:
            monkeypatch.setenv("ASYNCRL_TEST_TOOL_KEY", value)
        with pytest.raises(ConfigError, match="env.http.auth_env.*ASYNCRL_TEST_TOOL_KEY"):
            HttpTool(server.url, auth_env="ASYNCRL_TEST_TOOL_KEY")


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
    with pytest.raises(Exception, match="env.http.timeout_s"):
        HttpTool("http://x/", timeout_s=float("inf"))
    with pytest.raises(Exception, match="env.http.max_consecutive_failures"):
        HttpTool("http://x/", max_consecutive_failures=-1)
    with pytest.raises(Exception, match="env.http.auth_env"):
        HttpTool("http://x/", auth_env="")


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
        env.remote.check_health()
    finally:
        env.close()
