"""Sharded training: FSDP2 (``fully_shard``) through Lightning's ``ModelParallelStrategy``.

    python train.py recipe=sync_grpo trainer=fsdp_cpu                      # 2 gloo ranks on the CPU
    python train.py recipe=sync_grpo trainer=fsdp_gpu engine=vllm_gpu trainer.devices=4

Each rank holds 1/N of every parameter, its gradient and its AdamW state (DTensor shards over a
1-D ``data_parallel`` mesh; one FSDP unit per decoder layer, the HF model's
``_no_split_modules``, plus the root for the embeddings, final norm and head). Lightning's
``FSDPStrategy`` (FSDP1) is not an option on the CPU: Lightning refuses it ("The strategy `fsdp`
requires a GPU accelerator") and torch's FSDP1 itself raises "FSDP needs a non-CPU accelerator
device"; FSDP2 runs on gloo (``tests/integration/test_sharding.py``).

Under FSDP every forward of the policy is a collective (each unit all-gathers its
parameters), so a forward that only some ranks run, or that ranks run a different number of
times, hangs. Here the forwards are data-dependent: pi_old / ``Recompute`` passes run only on
ranks whose rows need them, the packed layout's first-call check needs two usable rows, and the
weight-sync verify runs on rank 0 only. So the units are built with
``reshard_after_forward=False`` and every rank gathers the whole policy at points all ranks
reach together (``unshard``: the start of each training step; ``gathered``: the verify pass):
in between, forwards are local, whatever their number. The backward reduce-scatters each
unit's gradient and reshards it, so the optimizer step, the gradients and the optimizer state
stay sharded; a full copy of the parameters exists from the step's first forward to its
backward (FSDP2's ``reshard_after_forward=False``, "ZeRO-2" in DeepSpeed's terms). The
training forward itself must run the same number of times on every rank: ``module.forward``
packed or padded (``bucketed`` makes one forward per length bucket) and ``logit_chunk: null``
(the chunked head calls the trunk directly, past the root unit's hooks); ``validate_sharding``
says so at start-up.

The weight push gathers full tensors on every rank (``full_weights``: one all-gather per
tensor, in the same order everywhere); rank 0 sends them. Checkpoints are one full-state file
written by rank 0 (``save_distributed_checkpoint: false``), loadable without the strategy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from omegaconf import DictConfig, OmegaConf

from modules.config.errors import check
from modules.config.schema import builds

# trainer.strategy strings Lightning would accept but this project cannot run (hint: the config)
STRATEGY_NAMES = ("auto", "ddp")
SHARDED_HINT = "trainer=fsdp_cpu (or fsdp_gpu) for sharded training"


def is_sharded(module: Any) -> bool:
    """True when ``module`` is an FSDP2 unit (``fully_shard`` applied)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def units(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def unshard(model: torch.nn.Module) -> None:
    """Collective: all-gather every unit's parameters (no-op for the units already whole). Until
    the next backward (or ``reshard``) the model's forwards run without communication."""
    for unit in units(model):
        unit.unshard()


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters (local, no communication)."""
    for unit in units(model):
        unit.reshard()


@contextmanager
def gathered(model: Any) -> Iterator[None]:
    """The whole policy gathered inside the block (every rank must enter it); no-op unsharded."""
    if not is_sharded(model):
        yield
        return
    unshard(model)
    try:
        yield
    finally:
        reshard(model)


def full_weights(model: torch.nn.Module, drop_tied_head: bool = True) -> dict[str, torch.Tensor]:
    """Collective: the HF state dict with every shard gathered into a full tensor, on every rank
    (same keys, same order everywhere). The tied ``lm_head`` is left out (vLLM ties it)."""
    from torch.distributed.tensor import DTensor

    sd = model.state_dict()
    if drop_tied_head and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}


def local_numel(tensors: Any) -> int:
    """Elements this rank holds of ``tensors`` (a DTensor counts its local shard)."""
    from torch.distributed.tensor import DTensor

    return sum(t.to_local().numel() if isinstance(t, DTensor) else t.numel() for t in tensors)


def shard_model(model: torch.nn.Module, mesh: Any, layer_classes: list[str] | None = None) -> list[str]:
    """``fully_shard`` each decoder layer, then the root; returns the unit classes used."""
    from torch.distributed.fsdp import fully_shard

    names = list(layer_classes or getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    check(
        "trainer.strategy.layer_classes",
        layer_classes,
        bool(layers),
        f"null (the model's _no_split_modules: {getattr(model, '_no_split_modules', None)}) or "
        f"class names of {type(model).__name__}'s repeated blocks",
    )
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return sorted({type(m).__name__ for m in layers})


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with every rank on the data-parallel axis (pure
    FSDP2, no tensor parallelism), sharding each HF model that is a direct child of the
    LightningModule (the policy; a frozen reference kept outside ``_modules`` stays whole)."""

    def __init__(
        self,
        layer_classes: list[str] | None = None,
        save_distributed_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        check(
            "trainer.strategy.layer_classes",
            layer_classes,
            layer_classes is None or (isinstance(layer_classes, list | tuple) and len(layer_classes) > 0),
            "null (the model's _no_split_modules) or a non-empty list of class names",
        )
        check(
            "trainer.strategy.process_group_backend",
            process_group_backend,
            process_group_backend in (None, "gloo", "nccl"),
            "null (gloo on the CPU, nccl on GPUs), gloo or nccl",
        )
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
        )
        self.layer_classes = list(layer_classes) if layer_classes else None

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        from transformers import PreTrainedModel

        mesh = self.device_mesh["data_parallel"]
        for child in self.lightning_module.children():
            if isinstance(child, PreTrainedModel) and not is_sharded(child):
                shard_model(child, mesh, self.layer_classes)
        super().setup(trainer)


def validate_sharding(cfg: DictConfig) -> None:
    """Start-up rules for ``trainer.strategy`` (before any engine or model is built)."""
    trainer = cfg.get("trainer") or {}
    strategy = trainer.get("strategy", "auto")
    if not isinstance(strategy, DictConfig | dict):
        check(
            "trainer.strategy",
            strategy,
            strategy in STRATEGY_NAMES,
            f"one of {', '.join(STRATEGY_NAMES)} (auto = ddp when trainer.devices > 1), or "
            f"{SHARDED_HINT}; Lightning's fsdp (FSDP1) needs a GPU and its hooks do not fit "
            "this module's data-dependent forwards",
        )
        return
    if not builds(strategy, FSDP2Strategy):
        return
    devices = trainer.get("devices")
    world = len(devices) if OmegaConf.is_list(devices) else devices
    ok = isinstance(world, int) and not isinstance(world, bool)
    world = (world if ok else 0) * int(trainer.get("num_nodes") or 1)
    check(
        "trainer.devices",
        devices,
        world >= 2,
        "an int >= 2 (or a list of 2+ devices) with the sharded strategy (one rank holds "
        "everything: use trainer=cpu / gpu)",
    )
    module = cfg.get("module") or {}
    forward = module.get("forward") or {}
    layout = str(forward.get("_target_", "")).rsplit(".", 1)[-1]
    check(
        "module.forward",
        layout,
        layout in ("", "PackedForward", "PaddedForward"),
        "packed or padded with the sharded strategy (bucketed runs one forward per length "
        "bucket, a number that differs between ranks: FSDP's collectives would hang)",
    )
    check(
        "module.forward.logit_chunk",
        forward.get("logit_chunk"),
        forward.get("logit_chunk") is None,
        "null with the sharded strategy (the chunked head calls the trunk past the root FSDP "
        "unit, whose parameters and gradients would not be gathered / reduced)",
    )
    check(
        "module.critic",
        "set" if module.get("critic") else None,
        not module.get("critic"),
        "null with the sharded strategy (the critic is not sharded and its gradients would not "
        "be reduced across ranks): use DDP (trainer=cpu / gpu) for recipe=ppo",
    )
