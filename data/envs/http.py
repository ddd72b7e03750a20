"""Tools and rewards served over HTTP, with request batching.

The protocol is one JSON POST: ``{"inputs": [x1, x2, ...]}`` -> ``{"outputs": [y1, y2, ...],
"errors": [null, "ValueError: ...", ...]}``, one output and one error per input, in order
(``errors`` may be left out: all ok; an entry that is not null is that input's failure, its
output is ignored). ``HttpTool.call(x)`` is a coroutine function, so an environment hands it to
``self.tools.call`` like any tool (concurrency limit, timeout, retries, latency model:
``tools.py``); calls that arrive within ``max_wait_s`` of each other go out as one request of
at most ``batch_size`` inputs (a judge or a reward model served elsewhere scores a batch at the
cost of one). ``serve(fn)`` starts such a server in this process (uvicorn on a daemon thread, a
local port) for tests and single-machine recipes; ``fn`` raising on one input fails that input
only. ``serve_app(app)`` runs any ASGI app the same way (test stand-ins).

    server = serve(lambda expr: calculate(expr))        # http://127.0.0.1:<port>/
    tool = HttpTool(server.url)
    result = await env.tools.call(tool.call, "47*38")   # ToolResult(ok=True, output=1786)

An OpenAI-compatible chat endpoint (a judge or a reward model) is ``chat_client.py``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from modules.config.errors import check

TEXT_LIMIT = 500  # characters of a server's answer kept in an error message


class RemoteError(RuntimeError):
    """A remote call failed; the message names the server's URL and what it said."""


class RemoteTimeout(RemoteError):
    """No answer within ``timeout_s``. Deliberately not a ``TimeoutError``: ``ToolRunner``
    would report its own timeout instead of this message."""


class RemoteDownError(RuntimeError):
    """A remote server failed ``max_consecutive_failures`` requests in a row: the run stops."""


def clip_text(text: str, limit: int = TEXT_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    text = text.strip()
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def bearer(auth_env: str | None, field: str) -> dict[str, str]:
    """The ``Authorization`` header from the environment variable named ``auth_env`` (none
    without one); a missing or empty variable is a ``ConfigError`` naming ``field``. Only the
    variable's name is ever stored or printed."""
    if auth_env is None:
        return {}
    check(
        field,
        auth_env,
        isinstance(auth_env, str) and auth_env != "",
        "null or the name of an environment variable",
    )
    value = os.environ.get(auth_env, "")
    check(
        field,
        auth_env,
        value != "",
        f"an environment variable that is set and not empty (${auth_env} is not)",
    )
    return {"Authorization": f"Bearer {value}"}


_SSL: list[Any] = []  # one SSL context for every client (loading the CA bundle is slow)
_SSL_LOCK = threading.Lock()


def http_client(timeout_s: float, auth_env: str | None, field: str, sync: bool = False) -> Any:
    """An httpx client (``AsyncClient``, or ``Client`` if ``sync``) with the auth header of
    ``auth_env``. Clients share one SSL context: made per client it costs tens of ms (seconds
    on a busy machine), charged to the first call's timeout."""
    import httpx

    with _SSL_LOCK:
        if not _SSL:
            _SSL.append(httpx.create_ssl_context())
    cls = httpx.Client if sync else httpx.AsyncClient
    return cls(timeout=timeout_s, headers=bearer(auth_env, field), verify=_SSL[0])


def network_error(url: str, e: Exception, timeout_s: float, field: str) -> RemoteError:
    """A client-side exception (refused, reset, timed out) as a ``RemoteError`` naming ``url``."""
    import httpx

    if isinstance(e, RemoteError):
        return e
    if isinstance(e, (asyncio.TimeoutError, httpx.TimeoutException)):
        return RemoteTimeout(f"{url}: no answer within {field}={timeout_s:g} s")
    if isinstance(e, httpx.ConnectError):
        return RemoteError(f"{url}: cannot connect ({e or type(e).__name__})")
    return RemoteError(f"{url}: request failed: {type(e).__name__}: {e}")


def answer_json(url: str, status: int, text: str) -> Any:
    """The JSON body of a 2xx answer; else a ``RemoteError`` with the status and the text."""
    if status >= 400:
        raise RemoteError(f"{url} answered HTTP {status}: {clip_text(text)}")
    try:
        return json.loads(text)
    except ValueError:
        raise RemoteError(f"{url} answered HTTP {status}, not JSON: {clip_text(text)}") from None


class Health:
    """Counts whole-request failures in a row; at ``max_consecutive_failures`` (0: never) the
    remote is down: ``down`` holds the reason and ``check_health()`` raises it."""

    url: str
    max_consecutive_failures: int

    def __init__(self) -> None:
        self.consecutive_failures = 0
        self.down: str | None = None
        self._health_lock = threading.Lock()

    async def on_own_loop(self, coro: Any) -> Any:
        """Await ``coro`` on this client's own I/O loop: callers on many loops (each environment
        call has one, ``env_calls.py``) share one batcher, one concurrency limit, one client."""
        with self._health_lock:
            if getattr(self, "_io", None) is None:
                from modules.engine.loop_thread import LoopThread

                async def ready() -> None:
                    return None

                self._io = LoopThread(f"asyncrl-remote-{type(self).__name__}")
                self._io.start(ready, timeout_s=30)
            io = self._io
        if asyncio.get_running_loop() is io.loop:
            return await coro
        return await asyncio.wrap_future(io.run(coro))

    def close_io(self) -> None:
        """Stop the I/O loop (its clients' connections go with it)."""
        io, self._io = getattr(self, "_io", None), None
        if io is not None:
            io.stop()

    def _succeeded(self) -> None:
        with self._health_lock:
            self.consecutive_failures = 0

    def _failed(self, error: Exception) -> None:
        with self._health_lock:
            self.consecutive_failures += 1
            n, limit = self.consecutive_failures, self.max_consecutive_failures
            if self.down is None and limit and n >= limit:
                self.down = f"{self.url} failed {n} requests in a row (max_consecutive_failures={limit}); last: {error}"

    def check_health(self) -> None:
        """Raise ``RemoteDownError`` naming the server if it is down; else do nothing."""
        if self.down is not None:
            raise RemoteDownError(self.down)


class HttpTool(Health):
    """Calls of one HTTP tool server, batched (protocol above).

    Fields (``env.http`` of a recipe): ``url``; ``batch_size`` (inputs per request, >= 1);
    ``max_wait_s`` (how long a call waits for others to share its request, [0, 10));
    ``timeout_s`` (per request, > 0: connect, send and answer together); ``max_consecutive_failures``
    (whole-request failures in a row after which the tool is down, 0 = never; default 20);
    ``auth_env`` (the NAME of an environment variable: requests carry ``Authorization: Bearer
    $auth_env``; missing or empty is a config error at construction).

    Errors: an input the server failed raises ``RemoteError`` with the server's message for
    that input only. A whole-request failure (HTTP 4xx/5xx, an answer that is not JSON or has
    the wrong number of outputs, refused, timed out) raises ``RemoteError`` with the status and
    the server's text (first 500 characters) in every call of the batch. Both become tool
    errors (observations) in ``ToolRunner``, which never lets a tool stop a run.

    The stop contract: after ``max_consecutive_failures`` whole-request failures in a row (a
    success resets the count) ``self.down`` holds the reason (the URL and the last error), every
    later call raises ``RemoteDownError`` at once without a request, and ``check_health()``
    raises ``RemoteDownError(self.down)``. The episode runner calls ``check_health()`` of an
    environment's remote tools (``remote_tools(env)``) after each step and lets the error end
    the run; ``check_health()`` is cheap and raises nothing while the tool is up.
    """

    def __init__(
        self,
        url: str,
        batch_size: int = 16,
        max_wait_s: float = 0.005,
        timeout_s: float = 10.0,
        max_consecutive_failures: int = 20,
        auth_env: str | None = None,
    ) -> None:
        super().__init__()
        if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ValueError(f"HttpTool: url={url!r} is not an http(s) URL")  # given by code, not config
        check("env.http.batch_size", batch_size, is_int(batch_size) and batch_size >= 1, "an int >= 1")
        check(
            "env.http.max_wait_s",
            max_wait_s,
            is_real(max_wait_s) and 0 <= max_wait_s < 10,
            "a float in [0, 10)",
        )
        check("env.http.timeout_s", timeout_s, is_real(timeout_s) and timeout_s > 0, "a finite float > 0")
        check(
            "env.http.max_consecutive_failures",
            max_consecutive_failures,
            is_int(max_consecutive_failures) and max_consecutive_failures >= 0,
            "an int >= 0 (0: never stop)",
        )
        bearer(auth_env, "env.http.auth_env")  # refused now, not at the first call
        self.url, self.batch_size, self.max_wait_s = url, batch_size, float(max_wait_s)
        self.timeout_s, self.max_consecutive_failures, self.auth_env = (
            float(timeout_s),
            max_consecutive_failures,
            auth_env,
        )
        self._loops: dict[int, _Batcher] = {}  # per event loop: a client and its queue
        self.requests = 0  # POSTs sent (fewer than calls when batching works)

    def __repr__(self) -> str:
        return f"HttpTool({self.url!r}, batch_size={self.batch_size}, auth_env={self.auth_env!r}, down={self.down!r})"

    async def call(self, x: Any) -> Any:
        """The server's output for ``x``; raises ``RemoteError`` or ``RemoteDownError``."""
        self.check_health()
        return await self.on_own_loop(self._call(x))

    async def _call(self, x: Any) -> Any:
        loop = asyncio.get_running_loop()
        batcher = self._loops.get(id(loop))
        if batcher is None:
            client = http_client(self.timeout_s, self.auth_env, "env.http.auth_env")
            batcher = self._loops[id(loop)] = _Batcher(client)
        fut: asyncio.Future = loop.create_future()
        batcher.queue.append((x, fut))
        if len(batcher.queue) >= self.batch_size:
            self._flush(batcher)
        elif batcher.timer is None:
            batcher.timer = loop.call_later(self.max_wait_s, self._flush, batcher)
        return await fut

    def _flush(self, batcher: _Batcher) -> None:
        if batcher.timer is not None:
            batcher.timer.cancel()
            batcher.timer = None
        batch, batcher.queue = batcher.queue[: self.batch_size], batcher.queue[self.batch_size :]
        if batch:
            self.requests += 1
            asyncio.get_running_loop().create_task(self._post(batcher, batch))
        if batcher.queue:  # more than one batch arrived at once
            batcher.timer = asyncio.get_running_loop().call_later(0, self._flush, batcher)

    async def _post(self, batcher: _Batcher, batch: list[tuple[Any, asyncio.Future]]) -> None:
        try:
            body = {"inputs": [x for x, _ in batch]}
            try:
                response = await asyncio.wait_for(batcher.client.post(self.url, json=body), self.timeout_s)
            except Exception as e:  # noqa: BLE001 - refused, reset, timed out: named below
                raise network_error(self.url, e, self.timeout_s, "env.http.timeout_s") from e
            outputs, errors = self._parse(response.status_code, response.text, len(batch))
        except Exception as e:  # noqa: BLE001 - every call of the batch fails with it
            self._failed(e)
            kind = type(e) if isinstance(e, RemoteError) else RemoteError
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(kind(str(e)))  # one exception per call: tracebacks stay apart
            return
        self._succeeded()
        for (_, fut), y, error in zip(batch, outputs, errors):
            if fut.done():
                continue
            if error is None:
                fut.set_result(y)
            else:
                fut.set_exception(RemoteError(f"{self.url} failed this input: {clip_text(str(error))}"))

    def _parse(self, status: int, text: str, n: int) -> tuple[list, list]:
        payload = answer_json(self.url, status, text)
        outputs = payload.get("outputs") if isinstance(payload, dict) else None
        errors = payload.get("errors") if isinstance(payload, dict) else None
        if errors is None:
            errors = [None] * n
        if not isinstance(outputs, list) or not isinstance(errors, list):
            raise RemoteError(
                f"{self.url} answered without an outputs list (and errors list or null): {clip_text(text)}"
            )
        if len(outputs) != n or len(errors) != n:
            raise RemoteError(
                f"{self.url} returned {len(outputs)} outputs for {n} inputs ({len(errors)} errors)"
            )
        return outputs, errors


def remote_tools(env: Any) -> list[Health]:
    """The remote tools an environment holds (``HttpTool``, ``ChatJudge``): as attributes, in
    lists, tuples or dicts of them, or one object down; for the runner's ``check_health()``."""
    found: list[Health] = []

    def visit(value: Any, depth: int) -> None:
        if isinstance(value, Health):
            found.append(value) if all(value is not f for f in found) else None
        elif isinstance(value, list | tuple | set):
            [visit(v, depth) for v in value]
        elif isinstance(value, dict):
            [visit(v, depth) for v in value.values()]
        elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, type):
            [visit(v, depth - 1) for v in vars(value).values()]

    [visit(v, 1) for v in vars(env).values()]
    return found


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class _Batcher:
    client: Any
    queue: list[tuple[Any, asyncio.Future]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
