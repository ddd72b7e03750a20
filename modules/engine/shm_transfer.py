"""Trainer-to-engine weight transfer through a safetensors file in shared memory (any device).

Selected by ``engine.weight_transfer=shm`` (the CPU default). Every tensor is copied to host
memory and written as one safetensors file to /dev/shm (the temp dir when /dev/shm lacks
room); each engine worker reads it back through ``WeightSyncExtension.asyncrl_load_weights``
(``modules/engine/worker_extension.py``). Tensors cannot travel as ``collective_rpc``
arguments (measured: it kills the engine), so only the path does. The GPU alternative, a
broadcast with no host copy, is ``modules/engine/nccl_transfer.py``; both implement
``WeightTransfer`` (``modules/engine/vllm.py``), so ``VLLMEngine.update_weights`` does not
care which one it has.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from modules.engine.reaper import scratch_prefix
from modules.engine.types import EngineError, WeightTransfer

LOAD_TIMEOUT_S = 300.0


class PreparedWeights:
    """Weights already written to one safetensors file (``prepared``): several engine replicas
    load the same file instead of each writing its own copy."""

    def __init__(self, path: str, count: int) -> None:
        self.path, self.count = path, count


@contextlib.contextmanager
def prepared(named_tensors: dict[str, torch.Tensor]) -> Iterator[PreparedWeights]:
    """Write ``named_tensors`` once to shared memory; the file is removed on exit."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in named_tensors.items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    from safetensors.torch import save_file

    prefix = scratch_prefix(os.getpid())  # the reaper removes it if this process is killed mid-sync
    with tempfile.NamedTemporaryFile(prefix=prefix, suffix=".safetensors", dir=scratch_dir(nbytes)) as f:
        save_file(tensors, f.name)
        yield PreparedWeights(f.name, len(tensors))


class SharedMemoryWeightTransfer:
    @staticmethod
    def engine_args() -> dict[str, Any]:
        return {}  # the worker extension is always installed (``VLLMEngine._build``)

    def send(self, named_tensors: dict[str, torch.Tensor] | PreparedWeights, llm: Any, run: Any) -> None:
        """Write the tensors to shared memory (unless ``prepared`` already did) and have every
        engine worker load them."""
        if isinstance(named_tensors, PreparedWeights):
            self._load(named_tensors, llm, run)
            return
        with prepared(named_tensors) as weights:
            self._load(weights, llm, run)

    @staticmethod
    def _load(weights: PreparedWeights, llm: Any, run: Any) -> None:
        loaded = run(llm.collective_rpc("asyncrl_load_weights", args=(weights.path,)), LOAD_TIMEOUT_S)
        if any(n != weights.count for n in loaded or ()):
            raise EngineError(f"an engine worker loaded {loaded} of {weights.count} tensors")

    def close(self) -> None:
        pass


def scratch_dir(nbytes: int) -> str | None:
    """/dev/shm when it has room (a RAM-backed hand-off), else the default temp dir."""
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * nbytes:
        return "/dev/shm"
    return None


def make_transfer(kind: str, engine_ranks: int, dtype: str, host: str = "127.0.0.1") -> WeightTransfer:
    """``engine.weight_transfer``: shm (this file) or nccl (GPU only, imported late)."""
    if kind == "nccl":
        from modules.engine.nccl_transfer import NCCLWeightTransfer

        return NCCLWeightTransfer(engine_ranks=engine_ranks, dtype=dtype, master_address=host)
    return SharedMemoryWeightTransfer()
