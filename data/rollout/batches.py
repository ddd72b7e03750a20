"""From a rollout batch of experiences to the optimizer steps that train on it.

``minibatches`` splits one rollout batch into ``minibatches`` x ``epochs`` collated minibatches
(a fresh shuffle per epoch); the last one is flagged ``sync_after`` when a weight sync is due,
so the ``WeightSync`` callback pushes the weights before the next rollout batch is requested.
``rollout_stats`` are the per-rollout-batch metrics the module logs with the first minibatch.
Both are shared by ``RolloutDataModule`` and ``tools.bound`` (training-only replay).
"""

from __future__ import annotations

import random
from typing import Any

from data.envs.base import turn_stats
from data.rollout.experience import Experience, collate


def minibatches(
    exps: list[Experience],
    n_minibatches: int,
    epochs: int,
    rng: random.Random,
    pad_id: int,
    stats: dict[str, float],
    sync_after: bool,
    world_size: int = 1,
) -> list[dict[str, Any]]:
    """The optimizer steps of one rollout batch (this rank's shard under DDP), in order."""
    n = len(exps)
    out = []
    for epoch in range(epochs):
        order = list(range(n))
        rng.shuffle(order)
        chunks = [order[k::n_minibatches] for k in range(n_minibatches)]
        for k, chunk in enumerate(chunks):
            batch: dict[str, Any] = collate([exps[i] for i in chunk], pad_id)
            batch["epoch"] = epoch
            batch["sync_after"] = sync_after and epoch == epochs - 1 and k == n_minibatches - 1
            batch["rollout_stats"] = stats if (epoch == 0 and k == 0) else {}
            # samples this optimizer step consumed across all ranks (equal shards)
            batch["num_samples"] = len(chunk) * world_size if epoch == 0 else 0
            out.append(batch)
    return out


def rollout_stats(exps: list[Experience]) -> dict[str, float]:
    """Per-rollout-batch statistics logged by the module."""
    n = len(exps)
    lengths = [len(e.response_ids) for e in exps]
    start = min(e.gen_start for e in exps)
    end = max(e.gen_end for e in exps)
    return {
        "train/reward_mean": sum(e.reward for e in exps) / n,
        "train/response_len_mean": sum(lengths) / n,
        "train/response_len_max": float(max(lengths)),
        "train/truncated_frac": sum(e.truncated for e in exps) / n,
        "rollout/gen_span_s": end - start,
        "rollout/tokens": float(sum(lengths)),
        # carried over: aborted and resubmitted, or generated across a weight update
        "rollout/carried_frac": sum(e.splits > 0 or len({v for v, _, _ in e.version_spans}) > 1 for e in exps)
        / n,
        # staleness histogram of this batch (share of samples 0, 1, 2, 3+ versions old)
        **{f"rollout/staleness_frac_{k}": sum(min(e.staleness, 3) == k for e in exps) / n for k in range(3)},
        "rollout/staleness_frac_3plus": sum(e.staleness >= 3 for e in exps) / n,
        **episode_stats(exps),
    }


def episode_stats(exps: list[Experience]) -> dict[str, float]:
    """Multi-turn episodes: turns per episode, model and observation tokens, tool errors."""
    turns = [e.extras["turns"] for e in exps if "turns" in e.extras]
    if not turns:
        return {}
    n = len(turns)
    masks = [e.loss_mask or [] for e in exps if "turns" in e.extras]
    stats = turn_stats(turns)
    names = {"turns": "env/turns_mean", "tool_calls": "env/tool_calls_mean"}
    names |= {"valid_call_rate": "env/valid_call_frac", "tool_error_rate": "env/tool_error_frac"}
    return {
        **{names[k]: v for k, v in stats.items()},
        "env/model_tokens_mean": sum(sum(m) for m in masks) / n,
        "env/observation_tokens_mean": sum(len(m) - sum(m) for m in masks) / n,
    }
