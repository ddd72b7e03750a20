"""Where the engine runs and where the trainer stays: cores on a CPU, GPUs on a GPU node.

On a CPU the engine's compute is pinned to ``engine.cpu_cores`` (``VLLM_CPU_OMP_THREADS_BIND``)
and the trainer process is kept off those cores (``CorePinning``), the CPU analogue of
dedicating GPUs to rollout. Every trainer process pins itself: rank 0 when it starts the
engine, the other DDP ranks in the datamodule's ``setup``, ``tools.bound`` around its
training-only measurement.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from modules.config.errors import check, check_choice

PROJECT_ROOT = Path(__file__).resolve().parents[2]
UNI_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


def parse_cores(spec: str) -> set[int]:
    """'1', '0-3', '0,2,4-5' -> set of core ids."""
    cores: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-")
            cores.update(range(int(lo), int(hi) + 1))
        elif part:
            cores.add(int(part))
    return cores


def names_cores(spec: object) -> bool:
    """True when ``engine.cpu_cores`` names cores (``0`` does; null and "" do not)."""
    return spec is not None and str(spec).strip() != ""


def configure_engine_env(cpu_cores: str | None, cpu_kvcache_gb: int, gpu_ids: list[int] | None) -> None:
    """Environment the engine's worker processes inherit (set before the engine is built). On
    GPUs, ``CUDA_VISIBLE_DEVICES`` is set around the build only (``modules.engine.gpus``)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # one INFO line per sync otherwise
    if gpu_ids is None:
        if names_cores(cpu_cores):
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_cores)
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kvcache_gb)
    # Workers are spawned: they must be able to import modules.engine.worker_extension.
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(PROJECT_ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), *filter(None, paths)])


def check_executor(executor: str | None, gpu_ids: object) -> None:
    """``engine.executor``: null (vLLM's own layout), uni (the worker inside the engine core:
    one device) or mp (a worker process per device)."""
    check_choice("engine.executor", executor, (None, "uni", "mp"))
    one_device = gpu_ids in (None, "auto") or isinstance(gpu_ids, str) or len(gpu_ids) == 1  # type: ignore[arg-type]
    check("engine.executor", executor, executor != "uni" or one_device, "null or mp with more than one GPU")


def executor_args(executor: str | None) -> dict[str, Any]:
    """vLLM engine arguments for ``engine.executor``. ``uni`` is passed as the executor's
    qualified name: vLLM-CPU rewrites the name "uni" to "mp" because its multiprocess executor
    is what binds the worker's OpenMP threads to ``VLLM_CPU_OMP_THREADS_BIND``;
    ``uni_process_pinning`` does that binding for the engine core process instead."""
    if executor == "uni":
        return {"distributed_executor_backend": UNI_EXECUTOR}
    return {} if executor is None else {"distributed_executor_backend": executor}


@contextmanager
def uni_process_pinning(executor: str | None, cpu_cores: str | int | None) -> Iterator[None]:
    """Around the engine's build with ``engine.executor=uni`` on a CPU: the engine core process
    (which then runs the model) is spawned from this thread, so it inherits this thread's
    affinity (``cpu_cores``) and ``OMP_NUM_THREADS`` (one thread per core); both are restored
    afterwards. Anything else: nothing changes."""
    if executor != "uni" or not names_cores(cpu_cores) or not hasattr(os, "sched_setaffinity"):
        yield
        return
    cores = parse_cores(str(cpu_cores))
    saved_affinity, saved_threads = os.sched_getaffinity(0), os.environ.get("OMP_NUM_THREADS")
    os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(len(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved_affinity)
        if saved_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_threads


class CorePinning:
    """Keep this process (and threads it creates later) off ``engine_cores``; ``release``
    restores the previous affinity, so the next engine of a multirun starts clean.

    ``engine_cores=None`` (an engine on GPUs, or ``engine.pin_trainer=false``) does nothing.
    Usable as a context manager.
    """

    def __init__(self, engine_cores: str | None) -> None:
        self.engine_cores = engine_cores
        self._saved: set[int] | None = None

    def apply(self) -> None:
        if (
            not names_cores(self.engine_cores)
            or self._saved is not None
            or not hasattr(os, "sched_setaffinity")
        ):
            return
        self._saved = os.sched_getaffinity(0)
        rest = self._saved - parse_cores(str(self.engine_cores))
        if rest:
            os.sched_setaffinity(0, rest)

    def release(self) -> None:
        if self._saved:
            os.sched_setaffinity(0, self._saved)
        self._saved = None

    def __enter__(self) -> CorePinning:
        self.apply()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
