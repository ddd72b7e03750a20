"""Leave ``train.py`` as soon as its work is done: skip the interpreter's C-level teardown.

    python train.py ...                        # exits ~2 s sooner than a plain interpreter exit
    ASYNCRL_FULL_TEARDOWN=1 python train.py    # the plain exit (memory checkers, debuggers)

After a run, CPython frees every module and object one by one and torch, vLLM and the
tokenizers run their C++ destructors: about 2 s on this 2-core machine, with nothing left to
save (measured with a probe: the last ``atexit`` handler returns 2 s before the process ends,
no Python frame running). ``exit_when_done`` does what the plain exit does that matters: it
joins the threads that are not daemons, runs every ``atexit`` handler (loggers' final uploads,
Lightning's and vLLM's clean-ups, coverage), flushes the streams, and ends with the run's exit
code (0, or the code of a ``SystemExit``: 2 for a config error, 130 / 143 for an interrupt).
An exception that escapes is not caught here: it prints its traceback and takes the plain exit.
The engine core does the same at its own exit (``modules/engine/worker_extension.py``).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn


def exit_code(code: Any) -> int:
    """What the interpreter would exit with for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")  # sys.exit("message"): printed, exit 1
    return 1


def exit_when_done(main: Callable[[], Any]) -> NoReturn:
    """Run ``main`` and leave with its exit code, the ``atexit`` handlers run, the teardown skipped."""
    try:
        main()
        code = 0
    except SystemExit as e:
        code = exit_code(e.code)
    if os.environ.get("ASYNCRL_FULL_TEARDOWN", "") not in ("", "0"):
        sys.exit(code)
    # what the interpreter's exit does first: threading's exit hooks (concurrent.futures wakes
    # its idle pool threads), then it waits for the threads that are not daemons
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()  # logging.shutdown, loggers, multiprocessing, weakref finalizers
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or a broken pipe: nothing more can be written
            pass
    try:  # C and C++ output buffered in libc (e.g. NCCL_DEBUG into a redirected stdout)
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(code)
