"""A judge or a reward model served elsewhere, behind an OpenAI-compatible chat-completions
endpoint (``vllm serve``, SGLang, TGI, a hosted API): a prompt in, a score in [0, 1] out.

    judge = ChatJudge("http://judge-host:8000", model="Qwen/Qwen2.5-7B-Instruct", auth_env="JUDGE_API_KEY")
    score = await judge.call(text)            # a tool: await self.tools.call(judge.call, text)
    score = judge.reward(row, response)       # a reward: plain, blocking, picklable

As the reward of a run, wrap the task (rows and prompts stay the task's, the reward is the
judge's; ``data.reward_errors`` and ``data.reward_timeout_s`` apply as to any reward)::

    task:
      _target_: data.envs.chat_client.JudgedTask
      task: {_target_: data.tasks.gsm8k.GSM8KTask}
      judge: {_target_: data.envs.chat_client.ChatJudge, url: "http://judge-host:8000", model: judge, auth_env: JUDGE_API_KEY}

A judge that fails ``max_consecutive_failures`` requests in a row is down, as an ``HttpTool``
is (``http.py``: ``down``, ``check_health()``); its later calls raise ``RemoteDownError`` at
once. The test stand-in server: ``tests/unit/test_chat_client.py``.
"""

from __future__ import annotations

import asyncio
import math
import re
import string
import threading
from collections.abc import Callable
from typing import Any

from data.envs.http import (
    Health,
    RemoteError,
    answer_json,
    bearer,
    clip_text,
    http_client,
    is_int,
    is_real,
    network_error,
)
from modules.config.errors import check

TEMPLATE = (
    "Rate the following response for correctness and quality on a scale from 0 to 1. "
    "Reply with the number only.\n\nResponse:\n{response}"
)
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class JudgeReplyError(RemoteError):
    """The judge answered, but its reply holds no score (the reply is in the message)."""


def first_number(reply: str, scale: float = 1.0) -> float:
    """The first number in ``reply`` divided by ``scale`` (10 for a 0-10 rating), clipped to
    [0, 1]; a reply without a number raises ``ValueError``. For Hydra: ``parser:
    {_target_: data.envs.chat_client.first_number, _partial_: true, scale: 10}``."""
    match = NUMBER.search(reply)
    if match is None:
        raise ValueError("no number in the reply")
    value = float(match[0]) / scale
    if not math.isfinite(value):
        raise ValueError(f"not a finite score: {match[0]}")
    return min(1.0, max(0.0, value))


class ChatJudge(Health):
    """Scores text with a chat model at ``url``. Bad settings raise a ``ConfigError`` naming
    ``task.judge.<field>`` (its place under ``JudgedTask``).

    ``url``: the server's base URL (posts to ``{url}/v1/chat/completions``; a URL ending in
    ``/v1`` gets ``/chat/completions``, one ending in ``/chat/completions`` is used as is).
    ``model``: the model name the server knows. ``auth_env``: the NAME of an environment
    variable holding an API key (sent as ``Authorization: Bearer ...``; missing or empty is a
    config error; the key is read when a client is made and never stored in a pickle).
    ``timeout_s``: per request (> 0). ``max_concurrency``: requests at once (>= 1), per event
    loop for ``call`` and across threads for ``reward``. ``temperature`` (>= 0),
    ``max_tokens`` (>= 1): sampling of the reply. ``template``: the user message, a
    ``str.format`` template with ``{response}`` and any fields of the row (``{prompt}``,
    ``{answer}``, ...). ``system``: an optional system message. ``parser``: reply text ->
    score (default ``first_number``: the first number, clipped to [0, 1]; a module-level
    function so that the judge pickles). ``max_consecutive_failures``: as ``HttpTool``'s.

    Errors (``RemoteError``, naming the endpoint): cannot connect; no answer within
    ``timeout_s`` (``RemoteTimeout``); HTTP 4xx/5xx or a body that is not a chat completion
    (status and the server's text, first 500 characters); a reply without a score
    (``JudgeReplyError``, with the reply). Only the first three count towards ``down``.
    """

    def __init__(
        self,
        url: str,
        model: str,
        auth_env: str | None = None,
        timeout_s: float = 30.0,
        max_concurrency: int = 8,
        temperature: float = 0.0,
        max_tokens: int = 16,
        template: str = TEMPLATE,
        parser: Callable[[str], float] = first_number,
        system: str | None = None,
        max_consecutive_failures: int = 20,
    ) -> None:
        super().__init__()
        check(
            "task.judge.url",
            url,
            isinstance(url, str) and url.startswith(("http://", "https://")),
            "an http(s) URL",
        )
        check("task.judge.model", model, isinstance(model, str) and model != "", "a model name")
        check("task.judge.timeout_s", timeout_s, is_real(timeout_s) and timeout_s > 0, "a finite float > 0")
        check(
            "task.judge.max_concurrency",
            max_concurrency,
            is_int(max_concurrency) and max_concurrency >= 1,
            "an int >= 1",
        )
        check(
            "task.judge.temperature", temperature, is_real(temperature) and temperature >= 0, "a float >= 0"
        )
        check("task.judge.max_tokens", max_tokens, is_int(max_tokens) and max_tokens >= 1, "an int >= 1")
        check(
            "task.judge.template",
            template,
            "response" in _fields(template),
            "a format string with {response}",
        )
        check("task.judge.parser", parser, callable(parser), "a function: reply text -> float")
        check("task.judge.system", system, system is None or isinstance(system, str), "null or a string")
        check(
            "task.judge.max_consecutive_failures",
            max_consecutive_failures,
            is_int(max_consecutive_failures) and max_consecutive_failures >= 0,
            "an int >= 0 (0: never stop)",
        )
        bearer(auth_env, "task.judge.auth_env")  # refused now, not at the first call
        base = url.rstrip("/")
        if not base.endswith("/chat/completions"):
            base += "/chat/completions" if base.endswith("/v1") else "/v1/chat/completions"
        self.url, self.model, self.auth_env = base, model, auth_env
        self.timeout_s, self.max_concurrency = float(timeout_s), max_concurrency
        self.temperature, self.max_tokens = float(temperature), max_tokens
        self.template, self.parser, self.system = template, parser, system
        self.max_consecutive_failures = max_consecutive_failures
        self.requests = 0
        self._local()

    def _local(self) -> None:
        """What a process holds of its own: clients, locks (left out of a pickle)."""
        self._loops: dict[int, tuple[Any, asyncio.Semaphore]] = {}
        self._client: Any = None
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.max_concurrency)
        self._health_lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(vars(self))
        for key in ("_loops", "_client", "_lock", "_slots", "_health_lock", "_io"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._local()

    def __repr__(self) -> str:
        return (
            f"ChatJudge({self.url!r}, model={self.model!r}, auth_env={self.auth_env!r}, down={self.down!r})"
        )

    def prompt(self, response: str, row: dict | None = None) -> str:
        """The user message: the template filled with the row's fields and ``response``."""
        fields = {**(row or {}), "response": response}
        missing = sorted(_fields(self.template) - set(fields))
        if missing:
            raise ValueError(
                f"task.judge.template names {missing}, which the row does not have (it has {sorted(fields)})"
            )
        return self.template.format_map(fields)

    def body(self, response: str, row: dict | None = None) -> dict[str, Any]:
        """The chat-completions request for one response."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": self.prompt(response, row)})
        return {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }

    async def call(self, text: str, row: dict | None = None) -> float:
        """The score of ``text`` (a coroutine: a tool for ``ToolRunner.call``)."""
        self.check_health()
        return await self.on_own_loop(self._call(text, row))

    async def _call(self, text: str, row: dict | None) -> float:
        body = self.body(text, row)
        loop = asyncio.get_running_loop()
        if id(loop) not in self._loops:
            client = http_client(self.timeout_s, self.auth_env, "task.judge.auth_env")
            self._loops[id(loop)] = (client, asyncio.Semaphore(self.max_concurrency))
        client, slots = self._loops[id(loop)]
        async with slots:
            self.requests += 1
            try:
                answer = await asyncio.wait_for(client.post(self.url, json=body), self.timeout_s)
            except Exception as e:  # noqa: BLE001 - refused, reset, timed out: named and counted
                raise self._network(e) from e
        return self._score(answer.status_code, answer.text)

    def reward(self, row: dict, response: str) -> float:
        """The score of ``response`` to ``row`` (blocking: the reward path calls it from a
        thread, or in a worker process with ``data.reward_timeout_s``)."""
        self.check_health()
        body = self.body(response, row)
        with self._lock:
            if self._client is None:
                self._client = http_client(self.timeout_s, self.auth_env, "task.judge.auth_env", sync=True)
            client = self._client
        with self._slots:
            self.requests += 1
            try:
                answer = client.post(self.url, json=body)
            except Exception as e:  # noqa: BLE001 - refused, reset, timed out: named and counted
                raise self._network(e) from e
        return self._score(answer.status_code, answer.text)

    __call__ = reward  # judge(row, response): a plain reward function

    def _network(self, e: Exception) -> RemoteError:
        error = network_error(self.url, e, self.timeout_s, "task.judge.timeout_s")
        self._failed(error)
        return error

    def _score(self, status: int, text: str) -> float:
        try:
            payload = answer_json(self.url, status, text)
            try:
                content = payload["choices"][0]["message"]["content"]
                assert isinstance(content, str)
            except Exception:  # noqa: BLE001 - any other shape
                raise RemoteError(
                    f"{self.url} answered without choices[0].message.content: {clip_text(text)}"
                ) from None
        except RemoteError as e:
            self._failed(e)
            raise
        self._succeeded()
        try:
            return float(self.parser(content))
        except Exception as e:  # noqa: BLE001 - the parser's failure, with the reply
            raise JudgeReplyError(f"{self.url}: no score in the reply {clip_text(content)!r}: {e}") from e


class JudgedTask:
    """``task`` with ``judge``'s score as its reward: rows, prompts and every other attribute
    are ``task``'s. Pickles when both do (``data.reward_timeout_s`` runs it in a worker)."""

    def __init__(self, task: Any, judge: Callable[[dict, str], float]) -> None:
        check("task.judge", judge, callable(judge), "a ChatJudge or a function (row, response) -> float")
        self.task, self.judge = task, judge

    def __repr__(self) -> str:
        return f"JudgedTask({self.task!r}, judge={self.judge!r})"

    def build(self, *args: Any, **kwargs: Any) -> Any:
        return self.task.build(*args, **kwargs)

    def prompt_text(self, row: dict) -> str:
        return self.task.prompt_text(row)

    def reward(self, row: dict, response: str) -> float:
        return float(self.judge(row, response))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "task":  # unpickling asks before task is set
            raise AttributeError(name)
        return getattr(self.task, name)


def _fields(template: Any) -> set[str]:
    """The field names of a ``str.format`` template (none if it is not one)."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
        return {re.split(r"[.\[]", name)[0] for name in names}  # {row[x]}, {a.b}: row, a
    except (TypeError, ValueError):
        return set()
