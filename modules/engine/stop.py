"""How the trainer stops vLLM's AsyncLLM: an intended shutdown that vLLM does not report as an
engine death, and, where the worker runs inside the engine core, a fast exit.

Inside the engine's loop the output handler is cancelled before the core goes away (otherwise
vLLM reports the intended shutdown as the engine dying). With ``engine.executor=uni`` the core
is first told the exit is intended (``WeightSyncExtension.asyncrl_exit_fast``) and skips the
interpreter's 2 s teardown after vLLM's own shutdown. Not with vLLM's worker processes, whose
exit the core waits on: there a fast exit left the core hanging until vLLM killed it, in 2 of 3
runs.

A SIGTERM the core does not act on is sent again (``RESEND_SIGTERM_S``). With the unit tier
running beside it, about 1 in 4 uni-executor cores here (11 of 45 stops) sat idle on their input
queue after vLLM's SIGTERM, with no signal pending or blocked, until vLLM killed them at the end
of the 30 s grace (exit -9); a second SIGTERM stopped each of the 4 it was tried on at once
(exit 0). Where the first one went was not found: CPython's handler never saw it (a wakeup fd
set in the core received no byte).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

SHUTDOWN_GRACE_S = 30.0
EXIT_FAST_TIMEOUT_S = 5.0
RESEND_SIGTERM_S = 2.0

log = logging.getLogger(__name__)


def stop_llm(llm: Any, loop_thread: Any, exit_fast: bool) -> None:
    """Stop ``llm`` on its loop thread when that still runs (``loop_thread``), else directly."""
    if loop_thread is not None:
        try:
            loop_thread.run(_shutdown(llm, exit_fast)).result(timeout=SHUTDOWN_GRACE_S + 30)
            return
        except Exception:
            pass
    llm.shutdown(timeout=SHUTDOWN_GRACE_S)


async def _shutdown(llm: Any, exit_fast: bool) -> None:
    if exit_fast and not getattr(llm, "errored", True):
        try:  # an engine that cannot answer exits as usual
            await asyncio.wait_for(llm.collective_rpc("asyncrl_exit_fast"), EXIT_FAST_TIMEOUT_S)
        except Exception:
            pass
    handler = getattr(llm, "output_handler", None)
    if handler is not None:
        handler.cancel()
    with _sigterm_again(_core_processes(llm) if exit_fast else []):
        llm.shutdown(timeout=SHUTDOWN_GRACE_S)


def _core_processes(llm: Any) -> list:
    """The engine core processes as psutil handles, taken before the stop (a handle refuses to
    signal a process whose pid was reused)."""
    import psutil

    try:
        procs = llm.engine_core.resources.engine_manager.processes
    except AttributeError:
        return []
    out = []
    for proc in procs:
        with contextlib.suppress(psutil.Error, ValueError):
            out.append(psutil.Process(proc.pid))
    return out


def catches_sigterm(pid: int) -> bool:
    """Whether ``pid`` still has a SIGTERM handler (``SigCgt`` in /proc). vLLM's core restores
    the default action as it starts to exit, and a SIGTERM after that would kill a core that is
    leaving cleanly; without /proc, False (nothing is sent again)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@contextlib.contextmanager
def _sigterm_again(procs: list) -> Iterator[None]:
    """While vLLM stops the engine: every ``RESEND_SIGTERM_S``, SIGTERM each core process that
    is still running and still catches SIGTERM (see the module docstring)."""
    if not procs:
        yield
        return
    import psutil

    done = threading.Event()

    def resend() -> None:
        while not done.wait(RESEND_SIGTERM_S):
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    if (
                        proc.is_running()
                        and proc.status() != psutil.STATUS_ZOMBIE
                        and catches_sigterm(proc.pid)
                    ):
                        log.warning("engine core %d still running after SIGTERM; sending it again", proc.pid)
                        proc.terminate()

    thread = threading.Thread(target=resend, name="asyncrl-sigterm-again", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
