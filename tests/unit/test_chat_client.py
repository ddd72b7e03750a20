"""A judge behind an OpenAI-compatible chat-completions endpoint (data/envs/chat_client.py),
against a local stand-in server (an ASGI app on a uvicorn thread, ``serve_app``): a good reply,
a server that is down, a slow one, a 500 with a message, the API key from the environment, a
reply without a score; as a tool coroutine and as a (picklable) reward."""

from __future__ import annotations

import asyncio
import json
import pickle
import socket
import time

import pytest

from data.envs.chat_client import ChatJudge, JudgedTask, JudgeReplyError, first_number
from data.envs.http import RemoteDownError, RemoteError, RemoteTimeout
from data.envs.http_server import serve_app
from modules.config.errors import ConfigError


class StandIn:
    """A chat-completions server whose answer the test sets: ``reply`` (the content), or
    ``status`` and ``text`` (an error), after ``delay_s``. Records each request."""

    def __init__(self) -> None:
        self.reply, self.status, self.text, self.delay_s = "Score: 0.8", 200, "", 0.0
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.requests.append({"path": scope["path"], "headers": headers, "body": json.loads(body)})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        if self.status == 200:
            answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": self.reply}}]}
            status, data = 200, json.dumps(answer).encode()
        else:
            status, data = self.status, self.text.encode()
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]}
        )
        await send({"type": "http.response.body", "body": data})


@pytest.fixture
def stand_in():
    app = StandIn()
    server = serve_app(app)
    app.url = server.url.rstrip("/")
    yield app
    server.stop()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


ROW = {"id": 3, "prompt": "47*38?", "answer": "1786"}


def test_a_good_reply_is_the_score_as_reward_and_as_tool(stand_in):
    judge = ChatJudge(stand_in.url, model="judge-7b", template="Q: {prompt}\nA: {response}\nScore 0-1:")
    assert judge.reward(ROW, "1786") == 0.8
    assert asyncio.run(judge.call("1786", ROW)) == 0.8
    request = stand_in.requests[0]
    assert request["path"] == "/v1/chat/completions"
    assert request["body"] == {
        "model": "judge-7b",
        "messages": [{"role": "user", "content": "Q: 47*38?\nA: 1786\nScore 0-1:"}],
        "temperature": 0.0,
        "max_tokens": 16,
    }
    stand_in.reply = "I'd give it 7 out of 10"
    assert judge.reward(ROW, "x") == 1.0  # clipped
    assert (
        ChatJudge(stand_in.url, model="m", parser=lambda t: first_number(t, scale=10)).reward(ROW, "x") == 0.7
    )


def test_a_reply_without_a_number_is_an_error_with_the_reply(stand_in):
    stand_in.reply = "I cannot judge this response."
    judge = ChatJudge(stand_in.url, model="m", max_consecutive_failures=1)
    with pytest.raises(JudgeReplyError, match="I cannot judge this response"):
        judge.reward(ROW, "x")
    assert judge.down is None  # the server answered: not a failure of the server


def test_a_down_server_is_an_error_naming_the_url_within_seconds():
    url = closed_port_url()
    judge = ChatJudge(url, model="m", timeout_s=5.0, max_consecutive_failures=2)
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match=f"{url}/v1/chat/completions.*cannot connect"):
        judge.reward(ROW, "x")
    with pytest.raises(RemoteError, match="cannot connect"):
        asyncio.run(judge.call("x"))
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(RemoteDownError, match=url):  # two in a row: down
        judge.check_health()
    with pytest.raises(RemoteDownError):
        judge.reward(ROW, "x")
    assert judge.requests == 2


def test_a_slow_server_times_out_within_timeout_s(stand_in):
    stand_in.delay_s = 30.0
    judge = ChatJudge(stand_in.url, model="m", timeout_s=0.5)

    def timed(score) -> float:
        t0 = time.monotonic()
        with pytest.raises(RemoteTimeout, match=r"no answer within task.judge.timeout_s=0.5 s"):
            score()
        return time.monotonic() - t0

    async def calls():
        return [await _timed_async(judge) for _ in range(3)]

    for seconds in (asyncio.run(calls()), [timed(lambda: judge.reward(ROW, "x")) for _ in range(3)]):
        # after the first call (which makes the client): within timeout_s + 1 s, the faster of
        # two (a busy shared machine can stall one), and none near the server's 30 s
        assert min(seconds[1:]) < 0.5 + 1.0 and max(seconds) < 0.5 + 3.0, seconds


async def _timed_async(judge: ChatJudge) -> float:
    t0 = time.monotonic()
    with pytest.raises(RemoteTimeout, match=r"no answer within task.judge.timeout_s=0.5 s"):
        await judge.call("x")
    return time.monotonic() - t0


def test_a_500_carries_the_servers_message(stand_in):
    stand_in.status, stand_in.text = 500, "model overloaded: shard 3 out of memory"
    judge = ChatJudge(stand_in.url, model="m")
    with pytest.raises(RemoteError, match="HTTP 500: model overloaded: shard 3 out of memory"):
        judge.reward(ROW, "x")
    with pytest.raises(RemoteError, match="shard 3 out of memory"):
        asyncio.run(judge.call("x"))
    stand_in.status, stand_in.text = 200, '{"id": "x"}'  # not a completion
    stand_in.reply = None
    with pytest.raises(RemoteError, match="without choices"):
        judge.reward(ROW, "x")
    assert judge.consecutive_failures == 3


def test_the_api_key_comes_from_the_environment_and_never_into_a_pickle(stand_in, monkeypatch):
    monkeypatch.setenv("ASYNCRL_TEST_JUDGE_KEY", "sk-test-123")
    judge = ChatJudge(stand_in.url + "/v1", model="m", auth_env="ASYNCRL_TEST_JUDGE_KEY")
    judge.reward(ROW, "x")
    asyncio.run(judge.call("x"))
    assert [r["headers"]["authorization"] for r in stand_in.requests] == ["Bearer sk-test-123"] * 2
    assert [r["path"] for r in stand_in.requests] == ["/v1/chat/completions"] * 2
    data = pickle.dumps(judge)
    assert b"sk-test-123" not in data and "sk-test-123" not in repr(judge)
    assert pickle.loads(data).reward(ROW, "x") == 0.8  # a worker process's copy works
    monkeypatch.delenv("ASYNCRL_TEST_JUDGE_KEY")
    with pytest.raises(ConfigError, match="task.judge.auth_env.*ASYNCRL_TEST_JUDGE_KEY"):
        ChatJudge(stand_in.url, model="m", auth_env="ASYNCRL_TEST_JUDGE_KEY")


def test_max_concurrency_bounds_requests_at_once(stand_in):
    stand_in.delay_s = 0.2
    judge = ChatJudge(stand_in.url, model="m", max_concurrency=2)

    async def many():
        return await asyncio.gather(*(judge.call(str(i)) for i in range(6)))

    assert asyncio.run(many()) == [0.8] * 6 and stand_in.max_in_flight == 2


def test_as_the_reward_of_a_task(stand_in):
    from data.tasks.calculator import CalculatorTask

    task = JudgedTask(CalculatorTask(), ChatJudge(stand_in.url, model="m", template="{prompt} {response}"))
    row = task.build("train", 1)[0]
    assert task.prompt_text(row) == CalculatorTask().prompt_text(row)
    assert task.reward(row, "a1.") == 0.8
    assert stand_in.requests[0]["body"]["messages"][0]["content"] == f"{row['prompt']} a1."
    copy = pickle.loads(pickle.dumps(task))
    assert copy.reward(row, "a1.") == 0.8


def test_bad_settings_name_the_field():
    for kwargs, name in [
        ({"url": "judge:8000"}, "task.judge.url"),
        ({"model": ""}, "task.judge.model"),
        ({"timeout_s": 0}, "task.judge.timeout_s"),
        ({"max_concurrency": 0}, "task.judge.max_concurrency"),
        ({"temperature": -1.0}, "task.judge.temperature"),
        ({"max_tokens": 0}, "task.judge.max_tokens"),
        ({"template": "no field"}, "task.judge.template"),
        ({"max_consecutive_failures": -1}, "task.judge.max_consecutive_failures"),
    ]:
        with pytest.raises(ConfigError, match=name):
            ChatJudge(**{"url": "http://x", "model": "m", **kwargs})
    assert ChatJudge("http://x/v1/chat/completions", model="m").url == "http://x/v1/chat/completions"
    assert ChatJudge("http://x/", model="m").url == "http://x/v1/chat/completions"
    with pytest.raises(ValueError, match=r"task.judge.template names \['answer'\]"):
        ChatJudge("http://x", model="m", template="{answer} {response}").prompt("r", {"id": 1})
