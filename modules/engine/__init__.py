"""Rollout engines: the vLLM engine on its own devices and a simulated one, behind one protocol.

    types.py             Completion, SamplingConfig, EngineError, the Engine protocol
    vllm.py              VLLMEngine: AsyncLLM on a background thread with its own event loop
    placement.py         engine cores / GPUs, keeping the trainer off the engine's cores
    shm_transfer.py      weights to the engine through /dev/shm (any device)
    nccl_transfer.py     weights to the engine by NCCL broadcast (engine on GPUs)
    worker_extension.py  the engine-side loader vLLM mixes into its workers
    reaper.py            kills the engine's processes if the trainer dies without shutting down
    sim.py               SimEngine: a virtual-clock engine for the simulator and tests

Only ``types`` is imported here: the package stays light for the reaper process.
"""

from modules.engine.types import INFLIGHT_MODES, Completion, Engine, EngineError, SamplingConfig

__all__ = ["INFLIGHT_MODES", "Completion", "Engine", "EngineError", "SamplingConfig"]
