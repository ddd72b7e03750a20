"""Collectives on metrics: reduce a step's metric dict over DDP ranks; agree on finiteness."""

from __future__ import annotations

from typing import Any

import torch


def reduce_over_ranks(values: dict[str, Any], device: torch.device, world: int) -> dict[str, torch.Tensor]:
    """Loss metrics over all DDP ranks in two collectives: the max of ``*_max`` / ``*/max_*``
    keys, the min of ``*_min`` keys, the mean of the rest (each rank's loss is its share of the
    global loss, so their mean is the global loss)."""
    import torch.distributed as dist

    names = list(values)
    t = torch.stack(
        [torch.as_tensor(values[n], dtype=torch.float64, device=device).reshape(()) for n in names]
    )
    is_max = torch.tensor([n.endswith("_max") or "/max_" in n for n in names], device=device)
    is_min = torch.tensor([n.endswith("_min") for n in names], device=device)
    low = torch.tensor(float("-inf"), dtype=torch.float64, device=device)
    extremes = torch.cat([torch.where(is_max, t, low), torch.where(is_min, -t, low)])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    sums = torch.where(is_max | is_min, torch.zeros_like(t), t)
    dist.all_reduce(sums)
    n = len(names)
    out = torch.where(is_max, extremes[:n], torch.where(is_min, -extremes[n:], sums / world))
    return {name: out[i] for i, name in enumerate(names)}


def sum_over_ranks(t: torch.Tensor, world: int) -> torch.Tensor:
    """``t`` summed over the DDP ranks, in place (as is with one process)."""
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(t)
    return t


def all_ranks_finite(loss: torch.Tensor, logp: torch.Tensor, device: torch.device, world: int) -> bool:
    """True when loss and logprobs are finite on every rank. Under DDP one rank skipping
    alone would leave the others waiting forever in the gradient all-reduce."""
    finite = torch.tensor(float(bool(torch.isfinite(loss)) and bool(torch.isfinite(logp).all())))
    if world > 1:
        import torch.distributed as dist

        finite = finite.to(device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item() > 0)


def ranks_divide_rollout_batch(cfg: Any) -> None:
    """Cross-field rule: DDP ranks train equal shards of every minibatch."""
    from modules.config.errors import batch_shape, check, world_size

    shape = batch_shape(cfg)
    if shape is None:
        return
    batch, minibatches, world = shape[0] * shape[1], shape[2], world_size(cfg)
    check(
        "trainer.devices",
        cfg.trainer.get("devices"),
        world == 1 or batch % (world * minibatches) == 0,
        f"a rank count that, times algo.minibatches={minibatches}, divides the rollout batch "
        f"rollout.prompts_per_step * rollout.group_size = {batch} (DDP ranks train equal shards)",
    )
