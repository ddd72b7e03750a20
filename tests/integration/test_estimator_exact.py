"""The documented estimator is the computed one: DDP normalisation, gates in decoupled mode,
the KL gradient's direction, self-normalisation, Recompute and dropout.

Each test here failed on the code before these fixes (numbers in the closing note of the
issue that added them).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from modules.algo import corrections as C
from modules.algo.losses import AGGREGATIONS, batch_counts, policy_loss

WORLD = 2


def make_batch(seed: int = 0, b: int = 8, t: int = 12):
    """Sequences of very unequal lengths (rank 0 gets the short half, rank 1 the long half)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 2, 2, 3, 9, 11, 12, 12])[:b]
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    base = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 0.1
    behavior = base + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ref = base + 0.2 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return base, behavior, ref, adv, mask


def loss_grad(rows: slice, mode: str, totals=None, world: int = 1) -> torch.Tensor:
    """Gradient w.r.t. the full [B, T] logprob tensor of the loss on ``rows`` only."""
    base, behavior, ref, adv, mask = make_batch()
    logp = base.clone().requires_grad_(True)
    loss, _ = policy_loss(
        logp[rows] * 1.0,
        behavior[rows],
        adv[rows],
        mask[rows],
        correction=C.TruncatedTokenIS(2.0),
        anchor="decoupled",
        old_logp=behavior[rows] + 0.05,
        aggregation=mode,
        norm_const=12,
        ref_logp=ref[rows],
        kl_coef=0.5,
        totals=totals,
        world_size=world,
    )
    loss.backward()
    return logp.grad


def _rank(rank: int, path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    rows = slice(rank * 4, (rank + 1) * 4)  # whole halves: rank 1 holds 5x the tokens of rank 0
    grads = {}
    for mode in AGGREGATIONS:
        mask = make_batch()[4][rows]
        totals = batch_counts(mask)
        dist.all_reduce(totals)  # what PolicyGradientModule._global_counts does
        g = loss_grad(rows, mode, totals, WORLD)
        dist.all_reduce(g)  # DDP: sum, then divide by the world size
        grads[mode] = g / WORLD
    if rank == 0:
        torch.save(grads, out)
    dist.destroy_process_group()


def on_two_ranks(fn) -> object:
    """Run ``fn(rank, store_path, out_path)`` on 2 gloo ranks; what rank 0 saved to out_path."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        mp.spawn(fn, args=(os.path.join(tmp, "store"), out), nprocs=WORLD, join=True)
        return torch.load(out)


def test_ddp_gradient_equals_one_process_on_the_whole_batch():
    ddp = on_two_ranks(_rank)
    for mode in AGGREGATIONS:
        single = loss_grad(slice(None), mode)
        rel = float((ddp[mode] - single).norm() / single.norm())
        assert rel < 1e-5, (mode, rel)
        # and the per-rank normalisation it replaces is measurably wrong on this batch
        local = sum(loss_grad(slice(r * 4, (r + 1) * 4), mode) for r in range(WORLD)) / WORLD
        if mode == "token_mean":
            assert float((local - single).norm() / single.norm()) > 0.1


def _reduce_rank(rank: int, path: str, out: str) -> None:
    from modules.policy.policy_gradient import reduce_over_ranks

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    values = {
        "train/loss": torch.tensor(1.0 + 2 * rank),  # a CPU tensor and plain floats both work
        "is/weight_max": 3.0 - rank,
        "is/weight_min": 0.5 + rank,
        "mismatch/max_abs_logp_diff": float(rank),
    }
    reduced = reduce_over_ranks(values, torch.device("cpu"), WORLD)
    if rank == 0:
        torch.save({k: float(v) for k, v in reduced.items()}, out)
    dist.destroy_process_group()


def test_loss_metrics_are_reduced_over_ranks_by_their_kind():
    got = on_two_ranks(_reduce_rank)
    assert got == {
        "train/loss": 2.0,
        "is/weight_max": 3.0,
        "is/weight_min": 0.5,
        "mismatch/max_abs_logp_diff": 1.0,
    }
