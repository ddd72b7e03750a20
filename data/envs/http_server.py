"""A tool server in this process: ``serve(fn)`` answers the batched protocol of ``http.py``
(``{"inputs": [...]}`` -> ``{"outputs": [...], "errors": [...]}``, one error per input, so one
bad input fails only itself), uvicorn on a daemon thread and a local port, for tests and
single-machine recipes; ``serve_app(app)`` runs any ASGI app (a test's stand-in server).

    server = serve(calculate)        # http://127.0.0.1:<port>/
    tool = HttpTool(server.url)
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any


class Server:
    """A local HTTP server in this process: of ``fn`` (one input -> one output, a function or a
    coroutine function) under the protocol above, or of any ASGI ``app``."""

    def __init__(
        self, fn: Callable[[Any], Any] | None = None, host: str = "127.0.0.1", port: int = 0, app: Any = None
    ) -> None:
        import uvicorn

        from data.envs.tools import is_async

        self.fn, self._async = fn, fn is not None and is_async(fn)
        self.batches: list[int] = []  # inputs per request received
        self.authorization: list[str | None] = []  # the Authorization header of each request
        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}/"
        asgi = self._guard(app or self._app)
        config = uvicorn.Config(
            asgi, host=host, port=port, log_level="warning", lifespan="off", interface="asgi3"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="asyncrl-http-tool", daemon=True)

    def _guard(self, app: Any) -> Callable:
        async def guarded(scope: dict, receive: Callable, send: Callable) -> None:
            try:
                await app(scope, receive, send)
            except asyncio.CancelledError:
                if not self._server.should_exit:
                    raise  # stop() drops requests in flight quietly; nothing else may

        return guarded

    async def _app(self, scope: dict, receive: Callable, send: Callable) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = dict(scope.get("headers") or [])
        self.authorization.append(headers[b"authorization"].decode() if b"authorization" in headers else None)
        try:
            inputs = json.loads(body)["inputs"]
            assert isinstance(inputs, list), "inputs is not a list"
        except Exception as e:  # noqa: BLE001 - a bad request: the client sees why
            payload, status = {"error": f"bad request: {type(e).__name__}: {e}"}, 400
        else:
            self.batches.append(len(inputs))
            results = [await self._one(x) for x in inputs]
            payload, status = {"outputs": [y for y, _ in results], "errors": [e for _, e in results]}, 200
        start = {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
        await send(start)
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})

    async def _one(self, x: Any) -> tuple[Any, str | None]:
        """(output, None), or (None, the error's text): one input's failure is its own."""
        try:
            y = await self.fn(x) if self._async else self.fn(x)
            json.dumps(y)  # an output that cannot be sent fails its input only
            return y, None
        except Exception as e:  # noqa: BLE001 - sent back as text
            return None, f"{type(e).__name__}: {e}"

    def start(self, timeout_s: float = 10.0) -> Server:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the tool server at {self.url} did not start within {timeout_s:g} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop now: requests still in flight are dropped, not waited for."""
        self._server.should_exit = self._server.force_exit = True
        self._thread.join(5)


def serve(fn: Callable[[Any], Any], host: str = "127.0.0.1", port: int = 0) -> Server:
    """Start a local server of ``fn`` and return it (``.url``, ``.stop()``, ``.batches``)."""
    return Server(fn, host, port).start()


def serve_app(app: Any, host: str = "127.0.0.1", port: int = 0) -> Server:
    """Start a local server of an ASGI ``app`` (a stand-in for a remote service in tests)."""
    return Server(None, host, port, app=app).start()
