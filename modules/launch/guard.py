"""What surrounds ``trainer.fit`` in ``train.py``: exit codes, DDP stop, shutdown, heap trim.

    with guarded_fit(trainer, datamodule):
        trainer.fit(module, datamodule=datamodule)

* SIGHUP (the terminal went away) is handled as SIGTERM (not under ``nohup``).
* SIGTERM before the training loop (model load, engine start-up, first sync) unwinds the
  start-up (the engine is stopped, nothing is left running) and exits 143; during teardown it
  waits for the shutdown to finish.
* Ctrl-C and SIGTERM: Lightning turns them into ``SystemExit`` (after ``CheckpointOnInterrupt``
  wrote ``interrupted.ckpt``); the process exits 130 / 143 so a scheduler can tell them apart
  and requeue, also when shutting down after the signal raised an error of its own (the
  signal reaches the engine too, e.g. mid weight sync). Under DDP the other ranks stop with
  rank 0 and exit 0 (a nonzero exit of theirs would make Lightning's observer SIGKILL rank 0
  mid-shutdown).
* Any other failure on rank 0 kills the DDP ranks it launched, which would otherwise wait in
  a collective until its timeout.
* The datamodule is torn down (engine and reward workers stopped) however fit ends.
* After a successful job, freed heap pages go back to the OS and the process footprint is
  logged, so a Hydra multirun's next job starts from a trimmed heap and leaks show up.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from modules.callbacks.interrupts import CTRL_C_SEEN, EXIT_CTRL_C, EXIT_SIGTERM

log = logging.getLogger(__name__)


def _record_ctrl_c(received: list[int]) -> Any:
    """Note a Ctrl-C in ``received`` (then behave as before), so that an error that wins the
    race against the ``KeyboardInterrupt`` (the engine core, in the same process group, dying
    of the same SIGINT first) still exits 130. Returns the handler to restore."""

    if threading.current_thread() is not threading.main_thread():
        return None
    prev = signal.getsignal(signal.SIGINT)
    if prev in (signal.SIG_IGN, None):
        return None

    def handler(signum: int, frame: Any) -> Any:
        received.append(signum)
        if callable(prev):
            return prev(signum, frame)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    return prev


def _sigterm_outside_the_loop(shutting_down: threading.Event) -> Any:
    """SIGTERM while Lightning's own handler is not installed: before it (model load, engine
    start-up and first sync run in fit's setup) it raises ``SIGTERMException``, so the start-up
    unwinds through the engine's cleanup (with the default action the process would die at
    once and leave the half-started engine behind); after fit (teardown, engine shutdown) it
    lets the shutdown finish. While Lightning's handler is installed it calls this one too
    (it keeps existing handlers): then Lightning stops the loop at the step's end, as always.
    Returns the handler to restore."""
    if threading.current_thread() is not threading.main_thread():
        return None
    prev = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        if signal.getsignal(signal.SIGTERM) is not handler or shutting_down.is_set():
            return  # Lightning's (it stops at the step's end) / finishing the shutdown
        raise SIGTERMException()

    signal.signal(signal.SIGTERM, handler)
    return prev


def _hangup_as_sigterm() -> Any:
    """SIGHUP (the terminal or the session the run was started from went away) is handled as
    SIGTERM by whichever SIGTERM handler is active (ours before and after the loop,
    Lightning's in it): a checkpoint when something was trained, the engine stopped, exit 143.
    Its default action would kill the trainer at once (the reaper would still stop the engine,
    but no checkpoint would be written). Returns the handler to restore."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGHUP"):
        return None
    prev = signal.getsignal(signal.SIGHUP)
    if prev is signal.SIG_IGN:  # nohup: the user asked for the run to outlive the terminal
        return None
    signal.signal(signal.SIGHUP, lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM))
    return prev


@contextmanager
def guarded_fit(trainer: L.Trainer, datamodule: L.LightningDataModule) -> Iterator[None]:
    received = CTRL_C_SEEN
    received.clear()
    prev = _record_ctrl_c(received)
    shutting_down = threading.Event()
    prev_term = _sigterm_outside_the_loop(shutting_down)
    prev_hup = _hangup_as_sigterm()
    try:
        yield
    except SystemExit as e:
        code = exit_code(e)
        raise SystemExit(code if trainer.global_rank == 0 else 0) from None
    except BaseException as e:
        stop_other_ranks(trainer)
        code = interrupt_code(e)
        if code is None and received:
            code = EXIT_CTRL_C  # Ctrl-C came first; the error is its echo (a dead engine)
        if code is None:
            raise
        # The interrupt came first; shutting down after it failed too (e.g. Ctrl-C reached the
        # engine during a weight sync). The exit code still says "interrupted".
        log.error("interrupted (exit %d); shutting down also raised %r", code, e, exc_info=e)
        raise SystemExit(code if trainer.global_rank == 0 else 0) from None
    finally:
        shutting_down.set()
        if prev is not None:
            signal.signal(signal.SIGINT, prev)
        datamodule.teardown("fit")  # a no-op when Lightning already tore it down
        if prev_term is not None:
            signal.signal(signal.SIGTERM, prev_term)
        if prev_hup is not None:
            signal.signal(signal.SIGHUP, prev_hup)
    release_freed_memory()
    log.info("process after job: %s", process_footprint())


def exit_code(exc: SystemExit) -> int:
    """130 for Ctrl-C (Lightning exits from inside its KeyboardInterrupt handler), 143 for
    SIGTERM (``SIGTERMException``), else 1."""
    code = interrupt_code(exc)
    return 1 if code is None else code


def interrupt_code(exc: BaseException) -> int | None:
    """130 / 143 when ``exc`` is, or was raised while handling, a Ctrl-C / SIGTERM."""
    seen: BaseException | None = exc
    visited: set[int] = set()
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        if isinstance(seen, SIGTERMException):
            return EXIT_SIGTERM
        if isinstance(seen, KeyboardInterrupt):
            return EXIT_CTRL_C
        seen = seen.__cause__ or seen.__context__
    return None


def stop_other_ranks(trainer: L.Trainer) -> None:
    """On rank 0's failure, kill the DDP ranks it launched (no-op with one device)."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launcher = trainer.strategy.launcher
    if trainer.global_rank == 0 and isinstance(launcher, _SubprocessScriptLauncher):
        launcher.kill(signal.SIGKILL)


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``), so
    RSS after a job measures what is still referenced, not allocator slack."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc (e.g. macOS): nothing to trim
        pass


def process_footprint() -> str:
    import psutil

    me = psutil.Process()
    children = 0
    for child in me.children(recursive=True):
        try:
            children += "resource_tracker" not in " ".join(child.cmdline())
        except psutil.Error:
            continue
    return f"rss_mb={me.memory_info().rss / 2**20:.0f} threads={threading.active_count()} children={children}"
