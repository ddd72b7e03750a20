"""Exit codes of an interrupted run and whether a Ctrl-C arrived, shared by the checkpoint on
interrupt (``checkpointing.py``, which writes ``interrupted.ckpt``) and the guard around fit
(``modules/launch/guard.py``, which records the Ctrl-C and exits with the code), and the hold
that keeps a Ctrl-C out of a state change made of several statements (``ctrl_c_held``)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

EXIT_CTRL_C = 130  # 128 + SIGINT
EXIT_SIGTERM = 143  # 128 + SIGTERM
CTRL_C_SEEN: list[int] = []  # SIGINTs received during the current guarded fit


def ctrl_c_received() -> bool:
    """Whether a Ctrl-C reached this process during the current fit: an error raised after it
    (the engine core, in the same process group, dying of the same SIGINT first) is its echo."""
    return bool(CTRL_C_SEEN)


@contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Hold a Ctrl-C that arrives inside the block and raise it when the block ends, so state
    changed by several statements (a rollout batch taken from the controller: the bound's
    count, the buffer, what was handed out) is never half-changed in a checkpoint written on
    the interrupt. Keep the block short and free of waits. Off the main thread, or where
    Python's handler is not installed, it holds nothing (no Python handler runs there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    held: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            previous(signal.SIGINT, held[0])
