"""How the trainer stops vLLM's AsyncLLM: an intended shutdown that vLLM does not report as an
engine death, and, where the worker runs inside the engine core, a fast exit.

Inside the engine's loop the output handler is cancelled before the core goes away (otherwise
vLLM reports the intended shutdown as the engine dying). With ``engine.executor=uni`` the core
is first told the exit is intended (``WeightSyncExtension.asyncrl_exit_fast``) and skips the
interpreter's 2 s teardown after vLLM's own shutdown. Not with vLLM's worker processes, whose
exit the core waits on: there a fast exit left the core hanging until vLLM killed it, in 2 of 3
runs.
"""

from __future__ import annotations

import asyncio
from typing import Any

SHUTDOWN_GRACE_S = 30.0
EXIT_FAST_TIMEOUT_S = 5.0


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
    llm.shutdown(timeout=SHUTDOWN_GRACE_S)
