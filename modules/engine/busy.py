"""Busy-time accounting for ``perf/engine_idle_frac``: seconds with at least one request in flight."""

from __future__ import annotations

import threading
import time


class BusyClock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.inflight = 0
        self._since: float | None = None
        self._total = 0.0

    def enter(self) -> None:
        with self._lock:
            if self.inflight == 0:
                self._since = time.monotonic()
            self.inflight += 1

    def exit(self) -> None:
        with self._lock:
            self.inflight -= 1
            if self.inflight == 0 and self._since is not None:
                self._total += time.monotonic() - self._since
                self._since = None

    def seconds(self) -> float:
        with self._lock:
            extra = 0.0 if self._since is None else time.monotonic() - self._since
            return self._total + extra
