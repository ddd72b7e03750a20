"""Tools and rewards served over HTTP, with request batching.

The protocol is one JSON POST: ``{"inputs": [x1, x2, ...]}`` -> ``{"outputs": [y1, y2, ...]}``,
one output per input, in order. ``HttpTool.call(x)`` is a coroutine function, so an
environment hands it to ``self.tools.call`` like any tool (concurrency limit, timeout,
retries, latency model: ``tools.py``); calls that arrive within ``max_wait_s`` of each other
go out as one request of at most ``batch_size`` inputs (a judge or a reward model served
elsewhere scores a batch at the cost of one). ``serve(fn)`` starts such a server in this
process (uvicorn on a daemon thread, a local port) for tests and single-machine recipes.

    server = serve(lambda expr: calculate(expr))        # http://127.0.0.1:<port>/
    tool = HttpTool(server.url)
    result = await env.tools.call(tool.call, "47*38")   # ToolResult(ok=True, output=1786)
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modules.config.errors import check


class HttpTool:
    def __init__(
        self, url: str, batch_size: int = 16, max_wait_s: float = 0.005, timeout_s: float = 10.0
    ) -> None:
        if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ValueError(f"HttpTool: url={url!r} is not an http(s) URL")
        # the settings a recipe gives as env.http (data/tasks/calculator.py)
        check(
            "env.http.batch_size", batch_size, isinstance(batch_size, int) and batch_size >= 1, "an int >= 1"
        )
        check("env.http.max_wait_s", max_wait_s, 0 <= max_wait_s < 10, "a float in [0, 10)")
        check("env.http.timeout_s", timeout_s, timeout_s > 0, "a float > 0")
        self.url, self.batch_size, self.max_wait_s, self.timeout_s = url, batch_size, max_wait_s, timeout_s
        self._loops: dict[int, _Batcher] = {}  # per event loop: a client and its queue
        self.requests = 0  # POSTs sent (fewer than calls when batching works)

    async def call(self, x: Any) -> Any:
        loop = asyncio.get_running_loop()
        batcher = self._loops.get(id(loop))
        if batcher is None:
            import httpx

            batcher = self._loops[id(loop)] = _Batcher(httpx.AsyncClient(timeout=self.timeout_s))
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
            response = await batcher.client.post(self.url, json={"inputs": [x for x, _ in batch]})
            response.raise_for_status()
            outputs = response.json()["outputs"]
            if len(outputs) != len(batch):
                raise ValueError(f"{self.url} returned {len(outputs)} outputs for {len(batch)} inputs")
        except Exception as e:  # noqa: BLE001 - every call of the batch fails with it
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (_, fut), y in zip(batch, outputs):
            if not fut.done():
                fut.set_result(y)


@dataclass
class _Batcher:
    client: Any
    queue: list[tuple[Any, asyncio.Future]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class Server:
    """A local HTTP server of ``fn`` (one input -> one output) in this process."""

    def __init__(self, fn: Callable[[Any], Any], host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.fn = fn
        self.batches: list[int] = []  # inputs per request received
        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}/"
        config = uvicorn.Config(
            self._app, host=host, port=port, log_level="warning", lifespan="off", interface="asgi3"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="asyncrl-http-tool", daemon=True)

    async def _app(self, scope: dict, receive: Callable, send: Callable) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            inputs = json.loads(body)["inputs"]
            self.batches.append(len(inputs))
            payload, status = {"outputs": [self.fn(x) for x in inputs]}, 200
        except Exception as e:  # noqa: BLE001 - the client sees the error and its status
            payload, status = {"error": f"{type(e).__name__}: {e}"}, 500
        data = json.dumps(payload).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": data})

    def start(self, timeout_s: float = 10.0) -> Server:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the tool server at {self.url} did not start within {timeout_s:g} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(5)


def serve(fn: Callable[[Any], Any], host: str = "127.0.0.1", port: int = 0) -> Server:
    """Start a local server of ``fn`` and return it (``.url``, ``.stop()``)."""
    return Server(fn, host, port).start()
