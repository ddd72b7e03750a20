"""Exit codes of an interrupted run and whether a Ctrl-C arrived, shared by the checkpoint on
interrupt (``checkpointing.py``, which writes ``interrupted.ckpt``) and the guard around fit
(``modules/launch/guard.py``, which records the Ctrl-C and exits with the code)."""

from __future__ import annotations

EXIT_CTRL_C = 130  # 128 + SIGINT
EXIT_SIGTERM = 143  # 128 + SIGTERM
CTRL_C_SEEN: list[int] = []  # SIGINTs received during the current guarded fit


def ctrl_c_received() -> bool:
    """Whether a Ctrl-C reached this process during the current fit: an error raised after it
    (the engine core, in the same process group, dying of the same SIGINT first) is its echo."""
    return bool(CTRL_C_SEEN)
