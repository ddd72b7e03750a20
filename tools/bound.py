"""Measured throughput bound of a recipe on this machine: generation alone, then training alone.

    python -m tools.bound                                   # sync_grpo (the default recipe)
    python -m tools.bound recipe=async_grpo                 # any train.py overrides
    python -m tools.bound --gen-samples 4096 --train-batches 16 recipe=partial_grpo

The config is composed exactly as ``train.py`` composes it (``conf/train.yaml`` + overrides),
and the two halves of a pipeline are measured one after the other, then (``--shared``) at once:

(a) generation only: the recipe's engine (pinned to ``engine.cpu_cores``; starting it pins
    this process to the other cores, as in training) generates the recipe's prompts with its
    sampling parameters and group size, keeping as many groups in flight as the recipe does
    (``rollout.max_inflight`` groups for streaming and partial, ``rollout.prompts_per_step``
    for sync), topped up as each group completes, with no trainer. Rewards and advantages are
    computed as in training (on this process's core, as in training). Samples/s counts
    completed responses between the end of a warm-up and the end of the measured window.
    Then the weight-sync time (trainer weights -> engine, nothing in flight) is timed.
(b) training only: with the engine shut down, this process pinned like the trainer
    (``engine.pinning``) and ``torch_threads`` threads, the recipe's GRPO module runs
    Lightning training steps (forward, backward, clipping, optimizer; collation and the
    pi_old / recompute passes where the loss needs them) on the experiences generated in (a),
    split into rollout batches of P x G and minibatches x epochs steps by the datamodule's own
    ``data.rollout.batches.minibatches``.
    Samples/s counts trained samples after the warm-up rollout batches. One trainer process
    (``trainer.devices=1``); the experiences are the issued mix, in issue order, so a mode that
    trains a shorter mix (e.g. dropping stale long groups) has cheaper steps than this.

(c) both at once (``--shared``): the engine generates as in (a) in a background thread of this
    process while the module trains as in (b); each side's rate is taken over the same window.
    On a machine where the engine and the trainer share CPU cores, memory bandwidth or the
    trainer process's Python thread (the engine's output loop runs there), each side is slower
    while the other runs.

No pipeline of the two can train faster than ``bound_samples_per_s = min(gen, train)``. Weight
syncs stall both sides in every mode; ``bound_with_sync_samples_per_s`` charges one sync per
policy version on top (a tighter, still optimistic, bound). With (c),
``shared_estimate_samples_per_s`` is the best any schedule (overlapping, or one side alone)
could do if every overlap slowed both sides as much as (c) does (``best_schedule_rate``). (c)
runs the engine at full load; a pipeline that loads it less interferes less and can exceed the
estimate, so it is a measure of the interference, not a bound. Prints one JSON object (last
line).

This file is the command line, ``measure`` and the bound's arithmetic (``bound_key``,
``best_schedule_rate``); the measurements are in ``tools.bound_generation`` ((a), and the
background generation of (c)) and ``tools.bound_training`` ((b), (c)).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from modules.launch.compose import compose
from tools.bound_generation import concurrency_groups, measure_generation
from tools.bound_training import measure_training


def bound_key(cfg: DictConfig) -> str:
    """What the bound depends on. Recipes with equal keys share one measurement; the rollout
    mode itself does not enter (the bound has no barrier and no staleness policy)."""
    from hydra.utils import instantiate

    rollout = instantiate(cfg.rollout)
    rollout.batches_per_version = int(cfg.data.get("sync_every") or 1)
    parts = {
        "model": cfg.model.path,
        "task": OmegaConf.to_container(cfg.task, resolve=True),
        "engine": OmegaConf.to_container(cfg.engine, resolve=True),
        "P": rollout.prompts_per_step,
        "G": rollout.group_size,
        "concurrency_groups": concurrency_groups(rollout, cfg.engine.get("max_num_seqs")),
        "sampling": rollout.sampling.as_dict(),
        "algo": OmegaConf.to_container(cfg.algo, resolve=True),
        "module": OmegaConf.to_container(cfg.module, resolve=True),
        "trainer": {k: cfg.trainer.get(k) for k in ("precision", "gradient_clip_val", "accelerator")},
        "torch_threads": cfg.torch_threads,
        "sync_every": cfg.data.sync_every,
    }
    return json.dumps(parts, sort_keys=True, default=str)


def best_schedule_rate(gen: float, train: float, gen_shared: float, train_shared: float) -> float:
    """Most samples/s a pipeline can train when generation and training run at ``gen`` and
    ``train`` alone and at ``gen_shared`` and ``train_shared`` while both run.

    A schedule overlaps the two for a fraction f of the time and runs one side alone for a and
    the other for b; it trains min(f gen_shared + a gen, f train_shared + b train) with
    f + a + b = 1. The achievable (generation, training) rates form the triangle with corners
    (gen_shared, train_shared), (gen, 0) and (0, train), so the best balanced point lies on one
    of the triangle's two edges from the overlap corner, or on the edge between the solo corners:
    overlap fully and spend the rest on the side that is short while both run, just enough to
    balance (with gen_shared <= train_shared: train_shared gen / (gen + train_shared -
    gen_shared), which is gen with no slowdown), or alternate without overlapping
    (gen train / (gen + train), better when overlapping slows the two badly: gen_shared / gen
    + train_shared / train < 1). Shared rates above the solo ones (noise) are taken as the solo
    ones.
    """
    if min(gen, train, gen_shared, train_shared) <= 0:
        raise ValueError("rates must be > 0")
    gc, tc = min(gen_shared, gen), min(train_shared, train)
    if gc <= tc:
        overlap = tc * gen / (gen + tc - gc)
    else:
        overlap = gc * train / (train + gc - tc)
    return max(overlap, gen * train / (gen + train))


# ---------------------------------------------------------------------------- entry point
def measure(
    overrides: list[str],
    gen_warmup: int = 256,
    gen_samples: int = 2048,
    train_warmup_batches: int = 1,
    train_batches: int = 8,
    shared: bool = False,
) -> dict[str, Any]:
    if gen_warmup < 1 or gen_samples < 1 or train_warmup_batches < 1 or train_batches < 1:
        raise ValueError("warm-ups and measured counts must be >= 1")
    import torch

    cfg = compose(overrides, output_dir="/tmp/asyncrl-bench")
    torch.set_num_threads(cfg.torch_threads)  # as train.py, before anything is built
    gen = measure_generation(cfg, gen_warmup, gen_samples)
    train = measure_training(cfg, gen["groups"], train_warmup_batches, train_batches)
    g_rate, t_rate = gen["figures"]["samples_per_s"], train["samples_per_s"]
    bound = min(g_rate, t_rate)
    both = None
    if shared:
        both = measure_training(cfg, gen["groups"], train_warmup_batches, train_batches, shared=True)
        both["estimate_samples_per_s"] = best_schedule_rate(
            g_rate, t_rate, both["generation_samples_per_s"], both["samples_per_s"]
        )
    per_version = int(cfg.rollout.prompts_per_step) * int(cfg.rollout.group_size) * int(cfg.data.sync_every)
    sync_s = gen["weight_sync_s"] or 0.0
    return {
        "overrides": overrides,
        "recipe": ([o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")] or ["sync_grpo"])[-1],
        "prompts_per_step": int(cfg.rollout.prompts_per_step),
        "group_size": int(cfg.rollout.group_size),
        "sampling": OmegaConf.to_container(cfg.rollout.sampling, resolve=True),
        "generation": gen["figures"],
        "training": train,
        "weight_sync_s": gen["weight_sync_s"],
        "bound_samples_per_s": bound,
        "limited_by": "generation" if g_rate <= t_rate else "training",
        "bound_with_sync_samples_per_s": 1.0 / (1.0 / bound + sync_s / per_version),
        # (c): both sides' rates while both run, and the best schedule at that slowdown
        "shared": both,
        "shared_estimate_samples_per_s": both["estimate_samples_per_s"] if both else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gen-warmup", type=int, default=256, help="responses before the timed window")
    parser.add_argument("--gen-samples", type=int, default=2048, help="responses in the timed window")
    parser.add_argument("--train-warmup-batches", type=int, default=1, help="untimed rollout batches")
    parser.add_argument("--train-batches", type=int, default=8, help="timed rollout batches of P x G")
    parser.add_argument("--shared", action="store_true", help="(c): also measure both sides at once")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("overrides", nargs="*", help="train.py (Hydra) overrides, e.g. recipe=async_grpo")
    args = parser.parse_args()
    result = measure(
        args.overrides,
        args.gen_warmup,
        args.gen_samples,
        args.train_warmup_batches,
        args.train_batches,
        args.shared,
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
