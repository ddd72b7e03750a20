"""The NCCL weight-transfer path (engine.weight_transfer=nccl), checked without a GPU.

CI has no GPU, so nothing here broadcasts. What is checked: the config field is validated,
the CPU path never needs it, every vLLM name modules/engine/nccl_transfer.py relies on exists
in the installed vLLM with the expected signature (an upgrade that renames one fails here,
not on somebody's GPU box), and the adapters forward what vLLM's trainer engine expects.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect

import pytest
import torch

from modules.config.errors import ConfigError
from modules.engine import EngineError
from modules.engine.vllm import VLLMEngine
from modules.launch.compose import build
from modules.launch.validate import validate
from tests.conftest import compose


def test_weight_transfer_must_be_shm_or_nccl():
    with pytest.raises(ConfigError, match=r"engine\.weight_transfer='bogus': must be one of shm, nccl"):
        VLLMEngine("unused", weight_transfer="bogus")


def test_nccl_needs_gpu_ids():
    with pytest.raises(ConfigError) as info:
        VLLMEngine("unused", weight_transfer="nccl")
    assert "engine.weight_transfer" in str(info.value) and "engine.gpu_ids" in str(info.value)


def test_nccl_engine_constructs_without_touching_vllm():
    eng = VLLMEngine("unused", gpu_ids=[1], cpu_cores=None, weight_transfer="nccl")
    assert eng.weight_transfer == "nccl" and eng._transfer is None  # built in start(), not here


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], "shm"),
        (["engine=vllm_gpu", "trainer.accelerator=gpu", "trainer.devices=[0]", "engine.gpu_ids=[1]"], "nccl"),
        (["engine=vllm_gpu", "trainer.accelerator=gpu", "engine.weight_transfer=shm"], "shm"),
    ],
)
def test_engine_groups_choose_their_transfer(overrides, expected):
    cfg = compose(overrides)
    validate(cfg)
    datamodule = build(cfg.data)  # cheap: the engine is only constructed, not started
    assert datamodule.engine.weight_transfer == expected


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_vllm_trainer_side_api_exists():
    from vllm.distributed.weight_transfer import (
        ParamMeta,
        TrainerWeightTransferEngine,
        VLLMWeightSyncClient,
        WeightSource,
        WeightTransferTrainerFactory,
    )
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    assert "nccl" in WeightTransferTrainerFactory._registry
    assert {"init_info", "client", "source"} <= set(_params(WeightTransferTrainerFactory.trainer_init))
    assert issubclass(NCCLTrainerWeightTransferEngine, TrainerWeightTransferEngine)
    assert NCCLTrainerWeightTransferEngine.init_info_cls is NCCLTrainerInitInfo
    assert callable(NCCLTrainerWeightTransferEngine.send_weights)
    assert callable(NCCLTrainerWeightTransferEngine.shutdown)
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=1, world_size=2, rank=0)
    assert info.backend == "nccl" and info.is_sender
    assert WeightSource.__abstractmethods__ == {"metadata", "__iter__"}
    assert [f.name for f in dataclasses.fields(ParamMeta)] == ["name", "dtype", "shape"]
    assert WeightTransferInitRequest(init_info={"a": 1}).init_info == {"a": 1}
    assert WeightTransferUpdateRequest(update_info={"b": 2}).update_info == {"b": 2}
    assert {
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    } <= {n for n in dir(VLLMWeightSyncClient) if not n.startswith("_")}


class _FakeLLM:
    """Records the AsyncLLM weight-transfer calls it receives."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    async def init_weight_transfer_engine(self, request):
        self.calls.append(("init", request.init_info))

    async def start_weight_update(self):
        self.calls.append(("start", None))

    async def update_weights(self, request):
        self.calls.append(("update", request.update_info))

    async def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))


def test_client_forwards_to_async_llm():
    from vllm.distributed.weight_transfer import VLLMWeightSyncClient

    from modules.engine.nccl_transfer import AsyncLLMSyncClient

    llm, timeouts = _FakeLLM(), []

    def run(coro, timeout):
        timeouts.append(timeout)
        return asyncio.run(coro)

    client = AsyncLLMSyncClient(llm, run, timeout_s=7.0)
    assert isinstance(client, VLLMWeightSyncClient)  # vLLM's (runtime-checkable) protocol
    client.init_weight_transfer_engine({"world_size": 2})
    client.start_weight_update()
    client.update_weights({"names": ["w"]})
    client.finish_weight_update()
    assert llm.calls == [
        ("init", {"world_size": 2}),
        ("start", None),
        ("update", {"names": ["w"]}),
        ("finish", None),
    ]
    assert timeouts == [7.0] * 4


def test_source_metadata_matches_iteration():
    from modules.engine.nccl_transfer import DictWeightSource

    tensors = {
        "model.embed_tokens.weight": torch.randn(8, 4),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4).t(),  # non-contiguous view
        "model.layers.1.mlp.up_proj.weight": torch.randn(4, 6),
        "model.norm.weight": torch.ones(4),
    }
    src = DictWeightSource(torch.device("cpu"), torch.bfloat16)
    src.set(tensors)
    meta = src.metadata()
    sent = list(src)
    assert [(m.name, m.dtype, m.shape) for m in meta] == [(n, t.dtype, tuple(t.shape)) for n, t in sent]
    assert all(t.dtype == torch.bfloat16 for _, t in sent)
    torch.testing.assert_close(sent[1][1], tensors["model.layers.0.mlp.up_proj.weight"].bfloat16())
    # vLLM's default per-layer grouping accepts the order (it raises on a mismatch).
    groups = [names for names, _ in src.iter_groups()]
    assert groups == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.mlp.up_proj.weight"],
        ["model.layers.1.mlp.up_proj.weight"],
        ["model.norm.weight"],
    ]
    src.set({"x": torch.zeros(2)})  # the next sync's tensors replace the last
    assert [m.name for m in src.metadata()] == ["x"]


def test_nccl_send_refuses_cpu_weights_and_skips_empty():
    from modules.engine.nccl_transfer import NCCLWeightTransfer

    transfer = NCCLWeightTransfer(engine_ranks=1, dtype="bfloat16")
    assert transfer.wire_dtype == torch.bfloat16
    transfer.send({}, llm=None, run=None)  # nothing to send: no group is opened
    assert transfer._sender is None
    with pytest.raises(EngineError, match=r"engine\.weight_transfer=nccl needs .* CUDA"):
        transfer.send({"w": torch.zeros(2)}, llm=None, run=None)
    assert NCCLWeightTransfer(engine_ranks=2).wire_dtype is None  # dtype auto: the trainer's
