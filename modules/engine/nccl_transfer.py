"""Trainer-to-engine weight transfer over NCCL, for an engine on dedicated GPUs.

Selected by ``engine.weight_transfer=nccl`` (the default of ``conf/engine/vllm_gpu.yaml``).
How it differs from the CPU path:

* CPU path (``engine.weight_transfer=shm``, the default, ``modules/engine/shm_transfer.py``):
  every tensor is copied to host memory, written as one safetensors file to /dev/shm and read
  back by each engine worker. It works anywhere, but every sync crosses host memory twice.
* This path: the engine is built with vLLM's ``WeightTransferConfig(backend="nccl")``, so each
  engine worker owns a ``NCCLWeightTransferEngine``. On the first sync the trainer process
  joins those workers in a private NCCL group (trainer = rank 0, engine workers = ranks
  1..N, rendezvous over a TCP store on ``engine.nccl_host``, 127.0.0.1 by default: the engine
  runs inside the trainer's rank-0 process, so its GPUs are on that node); from then on every sync is a broadcast
  from the trainer's GPU straight into the engine's GPUs, driven by vLLM's
  ``NCCLTrainerWeightTransferEngine.send_weights`` (start_weight_update -> update_weights
  concurrently with the broadcast -> finish_weight_update).

Only the process that owns the engine sends (DDP rank 0; DDP replicas hold identical weights).
Pausing generation, resetting the prefix cache, labelling the version and resuming stay in
``VLLMEngine.update_weights``, shared with the CPU path.

``VLLMEngine`` imports this file only when ``weight_transfer == "nccl"``; it imports vLLM's
weight-transfer base classes (importable without a GPU) and, lazily, its NCCL backend. Written
against vLLM 0.32; not run in this project's CI, which has no GPU (see docs/gpu.md).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    WeightSource,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)

from modules.engine.types import EngineError

# Runs a coroutine on the engine's event loop and returns its result (raising if the engine
# dies meanwhile); ``VLLMEngine`` passes ``wait_result(_call(coro), timeout)``.
RunOnEngine = Callable[[Coroutine[Any, Any, Any], float | None], Any]

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class AsyncLLMSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an in-process ``AsyncLLM``.

    vLLM's trainer engine drives the engine side through four blocking calls; here each one
    schedules the matching ``AsyncLLM`` coroutine on the engine thread's loop and waits.
    ``update_weights`` is called from a helper thread while the trainer thread broadcasts,
    which is safe: scheduling onto the loop is thread-safe.
    """

    def __init__(self, llm: Any, run: RunOnEngine, timeout_s: float = 600.0) -> None:
        self._llm = llm
        self._run = run
        self.timeout_s = timeout_s

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        # Blocks until the trainer has joined the group too (it does so meanwhile).
        request = WeightTransferInitRequest(init_info=init_info)
        self._run(self._llm.init_weight_transfer_engine(request), self.timeout_s)

    def start_weight_update(self) -> None:
        self._run(self._llm.start_weight_update(), self.timeout_s)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        request = WeightTransferUpdateRequest(update_info=update_info)
        self._run(self._llm.update_weights(request), self.timeout_s)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        # The version label is set by VLLMEngine.update_weights (shared with the CPU path).
        self._run(self._llm.finish_weight_update(weight_version), self.timeout_s)


class DictWeightSource(WeightSource):
    """vLLM ``WeightSource`` over the HF-named tensors of the current sync.

    vLLM's trainer engine keeps one source for its lifetime and re-iterates it every round,
    so the tensors are swapped in with ``set`` before each ``send_weights``. Tensors travel
    as ``wire_dtype`` (the engine's dtype; None keeps the trainer's) on ``device``.
    """

    def __init__(self, device: torch.device, wire_dtype: torch.dtype | None = None) -> None:
        self.device = device
        self.wire_dtype = wire_dtype
        self._tensors: dict[str, torch.Tensor] = {}

    def set(self, named_tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = dict(named_tensors)

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(name, self.wire_dtype or t.dtype, tuple(t.shape)) for name, t in self._tensors.items()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._tensors.items():
            # One tensor at a time: a dtype cast or device copy never holds the whole model twice.
            yield name, t.detach().to(device=self.device, dtype=self.wire_dtype or t.dtype)


class NCCLWeightTransfer:
    """Trainer side of the NCCL path; one per ``VLLMEngine``.

    ``engine_args()`` goes into ``AsyncEngineArgs``; ``send()`` pushes one set of weights
    (joining the NCCL group on its first call); ``close()`` releases the trainer's
    communicator (the engine's goes down with the engine).
    """

    def __init__(
        self,
        engine_ranks: int,
        dtype: str = "auto",
        master_address: str = "127.0.0.1",
        timeout_s: float = 600.0,
    ) -> None:
        self.engine_ranks = engine_ranks  # tensor-parallel workers of the engine
        self.wire_dtype = WIRE_DTYPES.get(dtype)  # "auto": send the trainer's dtype
        self.master_address = master_address
        self.timeout_s = timeout_s
        self._sender: Any = None  # vLLM NCCLTrainerWeightTransferEngine, after the first send
        self._source: DictWeightSource | None = None

    @staticmethod
    def engine_args() -> dict[str, Any]:
        """Extra ``AsyncEngineArgs``: give every engine worker an NCCL receiver."""
        from vllm.config import WeightTransferConfig

        return {"weight_transfer_config": WeightTransferConfig(backend="nccl")}

    def send(self, named_tensors: dict[str, torch.Tensor], llm: Any, run: RunOnEngine) -> None:
        """Broadcast ``named_tensors`` into the engine's model (generation must be paused)."""
        if not named_tensors:
            return  # nothing to load (benchmarks sync an empty dict to time the pause alone)
        device = _cuda_device(named_tensors)
        if self._sender is None:
            self._connect(device, llm, run)
        assert self._source is not None
        self._source.set(named_tensors)
        with torch.cuda.device(device):  # vLLM's sender uses the current CUDA device
            self._sender.send_weights()

    def _connect(self, device: torch.device, llm: Any, run: RunOnEngine) -> None:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        self._source = DictWeightSource(device, self.wire_dtype)
        init_info = NCCLTrainerInitInfo(
            master_address=self.master_address,
            master_port=_free_port(self.master_address),
            world_size=1 + self.engine_ranks,  # the trainer (rank 0) + each engine worker
            rank=0,  # the only sender: DDP replicas need not take part
        )
        client = AsyncLLMSyncClient(llm, run, self.timeout_s)
        with torch.cuda.device(device):
            self._sender = WeightTransferTrainerFactory.trainer_init(
                init_info, client=client, source=self._source
            )

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown()
            self._sender = None


def _cuda_device(named_tensors: dict[str, torch.Tensor]) -> torch.device:
    """The trainer GPU the weights live on; NCCL cannot send from host memory."""
    for t in named_tensors.values():
        if t.device.type == "cuda":
            return t.device
    kind = next(iter(named_tensors.values())).device.type
    raise EngineError(
        f"engine.weight_transfer=nccl needs the trainer's weights on a CUDA device, got {kind}: "
        "train with trainer.accelerator=gpu, or use engine.weight_transfer=shm"
    )


def _free_port(host: str) -> int:
    """A TCP port that is free now, for the NCCL group's rendezvous store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
