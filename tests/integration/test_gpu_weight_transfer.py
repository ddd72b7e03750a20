"""The vLLM side of the weight transfer, against the installed vLLM (imports it: not the unit tier)."""

from __future__ import annotations

import dataclasses
import inspect

from tests.unit.test_gpu_weight_transfer import _params


def test_vllm_engine_side_api_exists():
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.worker.gpu_worker import Worker

    assert WeightTransferConfig(backend="nccl").backend == "nccl"
    assert "weight_transfer_config" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert "nccl" in WeightTransferEngineFactory._registry
    for name, params in {
        "init_weight_transfer_engine": ["self", "request"],
        "start_weight_update": ["self"],
        "update_weights": ["self", "request"],
        "finish_weight_update": ["self", "weight_version"],
        "update_weight_version": ["self", "new_version"],
        "reset_prefix_cache": None,
        "pause_generation": None,
        "resume_generation": ["self"],
    }.items():
        fn = getattr(AsyncLLM, name)
        assert inspect.iscoroutinefunction(fn), name
        if params is not None:
            assert _params(fn) == params, (name, _params(fn))
    assert {"mode", "clear_cache"} <= set(_params(AsyncLLM.pause_generation))
    # What AsyncLLM's RPCs land on inside each GPU worker.
    for name in (
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ):
        assert callable(getattr(Worker, name)), name


def test_engine_args_are_accepted_by_vllm():
    from vllm.engine.arg_utils import AsyncEngineArgs

    from modules.engine.nccl_transfer import NCCLWeightTransfer

    args = AsyncEngineArgs(model="unused", **NCCLWeightTransfer.engine_args())
    assert args.weight_transfer_config.backend == "nccl"
