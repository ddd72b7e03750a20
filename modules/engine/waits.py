"""Waiting on an engine without hanging: every wait polls the engine's health.

Shared by ``VLLMEngine`` and ``ReplicatedEngine`` (several engines behind one dispatcher): a
class that mixes this in provides ``check_health()`` (raise ``EngineError`` if dead),
``health_poll_s`` and ``stall_timeout_s``.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Any

from modules.engine.types import EngineError


class HealthCheckedWaits:
    health_poll_s: float
    stall_timeout_s: float

    def check_health(self) -> None:
        raise NotImplementedError

    def clock(self) -> float:
        return time.monotonic()

    def wait_result(self, fut: cf.Future, timeout: float | None = None) -> Any:
        """``fut.result()`` that checks engine health while waiting."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return fut.result(timeout=self.health_poll_s)
            except cf.TimeoutError:
                self.check_health()
                if deadline is not None and time.monotonic() > deadline:
                    raise EngineError(f"engine call timed out after {timeout} s") from None

    def wait_any(self, pending: set[cf.Future]) -> set[cf.Future]:
        """Block until at least one future is done, checking engine health while waiting.

        Raises ``EngineError`` if the engine dies, or if nothing finishes within
        ``engine.stall_timeout_s`` (a live but stuck engine must not hang training).
        """
        deadline = time.monotonic() + self.stall_timeout_s
        while True:
            done, _ = cf.wait(pending, timeout=self.health_poll_s, return_when=cf.FIRST_COMPLETED)
            if done:
                return done
            self.check_health()
            if time.monotonic() > deadline:
                raise EngineError(
                    f"no response finished within engine.stall_timeout_s={self.stall_timeout_s:g} s "
                    f"({len(pending)} requests in flight): engine stalled"
                )

    def wait_on(self, cv: threading.Condition) -> None:
        """Called with ``cv`` held: let time pass, then raise if the engine died."""
        cv.wait(timeout=self.health_poll_s)
        self.check_health()
