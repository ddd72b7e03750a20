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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from modules.launch.compose import compose


def concurrency_groups(rollout: Any, engine_concurrency: int | None = None) -> int | str:
    """Groups the recipe keeps generating at once: sync ``prompts_per_step``; partial
    ceil(alpha x P) (``auto``: P + the engine's concurrency in groups, capped, see
    ``PartialRollout.groups_per_iteration``); streaming ``max_inflight`` (``auto``: min(the
    engine's concurrency in groups, P s (K + 1))). The string "auto" where no engine is known."""
    from data.rollout.partial import PartialRollout
    from data.rollout.sizing import Sizing
    from data.rollout.streaming import StreamingRollout

    if not isinstance(rollout, StreamingRollout):
        return rollout.prompts_per_step
    if isinstance(rollout, PartialRollout):
        if rollout.over_provision == "auto" and engine_concurrency is None:
            return "auto"
        return rollout.groups_per_iteration(engine_concurrency)
    if rollout.max_inflight == "auto" and engine_concurrency is None:
        return "auto"
    return Sizing.of(rollout, engine_concurrency).inflight


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


def _rollout_parts(cfg: DictConfig) -> tuple[Any, Any, Any, Any, Any]:
    """The recipe's task, rollout controller (its request / reward / advantage helpers only),
    engine (not started), tokenizer and prompt stream, as training builds them."""
    from hydra.utils import instantiate
    from transformers import AutoTokenizer

    from data.rollout.prompts import PromptStream

    task = instantiate(cfg.task)
    controller = instantiate(cfg.rollout)
    controller.configure_rewards(cfg.data.reward_errors, cfg.data.reward_timeout_s)  # as training
    engine = instantiate(cfg.engine)
    tokenizer = AutoTokenizer.from_pretrained(engine.model_path)
    prompts = PromptStream(list(task.build("train", cfg.data.train_size)), seed=cfg.seed)
    return task, controller, engine, tokenizer, prompts


class BackgroundGeneration:
    """(c): the engine generating the recipe's prompts at the recipe's concurrency, topped up as
    each group completes, in a thread of this process, until the context exits."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.done_times: list[float] = []
        self._stop = threading.Event()
        self._error: BaseException | None = None

    def __enter__(self) -> BackgroundGeneration:
        from hydra.utils import instantiate

        from data.rollout.controller import RolloutContext

        task, self.controller, self.engine, tokenizer, self.prompts = _rollout_parts(self.cfg)
        self.engine.start()
        try:
            advantage = instantiate(self.cfg.algo.advantage)
            self.controller.bind(
                RolloutContext(self.engine, task, tokenizer, self.prompts, advantage, seed=self.cfg.seed)
            )
            self.max_groups = concurrency_groups(self.controller, self.engine.concurrency)
            self._thread = threading.Thread(target=self._run, name="bound-generation", daemon=True)
            self._thread.start()
        except BaseException:
            self.controller.close()
            self.engine.shutdown()
            raise
        return self

    def _run(self) -> None:
        inflight: dict[Any, Any] = {}
        open_groups: dict[int, int] = {}
        try:
            while not self._stop.is_set():
                while len(open_groups) < self.max_groups:
                    started = self.controller.submit_group(self.prompts.next())
                    open_groups[next(iter(started.values())).group_id] = 0
                    inflight.update(started)
                for fut in self.engine.wait_any(set(inflight)):
                    p = inflight.pop(fut)
                    self.controller.to_experience(fut.result(), p)  # rewards scored as in training
                    self.done_times.append(time.perf_counter())
                    open_groups[p.group_id] += 1
                    if open_groups[p.group_id] == self.controller.group_size:
                        del open_groups[p.group_id]
        except BaseException as e:  # re-raised by __exit__
            self._error = e

    def samples_per_s(self, t0: float, t1: float) -> float:
        return sum(t0 < t <= t1 for t in self.done_times) / (t1 - t0)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # Requests still generating are not waited for: shutting the engine down ends them, and
        # the thread's wait returns within one completion or the engine's health poll.
        self._stop.set()
        self._thread.join(timeout=60)
        self.controller.close()
        self.engine.shutdown()
        if self._error is not None and exc_type is None:  # never mask the training's own error
            raise self._error


# ---------------------------------------------------------------------------- (a) generation
def measure_generation(cfg: DictConfig, warmup: int, samples: int, sync_trials: int = 3) -> dict[str, Any]:
    """Steady-state samples/s of the engine alone; returns the figures and the experiences."""
    from hydra.utils import instantiate

    from data.rollout.controller import RolloutContext
    from modules.policy.hf_policy import load_policy, named_weights

    task, controller, engine, tokenizer, prompts = _rollout_parts(cfg)
    max_groups = concurrency_groups(controller, engine.concurrency)
    g = controller.group_size
    engine.start()
    try:
        affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        controller.bind(
            RolloutContext(engine, task, tokenizer, prompts, instantiate(cfg.algo.advantage), seed=cfg.seed)
        )
        inflight: dict[Any, Any] = {}
        open_groups: dict[int, list] = {}
        groups: list[list] = []
        done_times: list[float] = []
        done_tokens: list[int] = []
        total = warmup + samples

        def top_up() -> None:
            while len(open_groups) < max_groups and len(done_times) < total:
                started = controller.submit_group(prompts.next())
                open_groups[next(iter(started.values())).group_id] = []
                inflight.update(started)

        top_up()
        while inflight:
            done = engine.wait_any(set(inflight))
            for fut in done:
                p = inflight.pop(fut)
                exp = controller.to_experience(fut.result(), p)
                done_times.append(time.perf_counter())
                done_tokens.append(len(exp.response_ids))
                group = open_groups[p.group_id]
                group.append(exp)
                if len(group) == g:
                    groups.append(controller.finish_group(open_groups.pop(p.group_id)))
            top_up()  # stops issuing once `total` responses are in; the rest drain untimed
        # Timed window: from the warmup-th completed response to the last one counted.
        t0, t1 = done_times[warmup - 1], done_times[total - 1]
        n = samples
        window_tokens = done_tokens[warmup:total]
        policy, _ = load_policy(engine.model_path)
        weights = named_weights(policy)
        sync_s = [engine.update_weights(weights, engine.version) for _ in range(sync_trials)]
    finally:
        controller.close()  # reward workers, if any
        engine.shutdown()
    groups.sort(key=lambda grp: grp[0].group_id)  # issue order: no completion-time bias
    return {
        "figures": {
            "concurrency_groups": max_groups,
            "concurrency_requests": max_groups * g,
            "engine_max_num_seqs": engine.max_num_seqs,
            "warmup_samples": warmup,
            "samples": n,
            "seconds": t1 - t0,
            "samples_per_s": n / (t1 - t0),
            "tokens_per_s": sum(window_tokens) / (t1 - t0),
            "response_len_mean": statistics.fmean(window_tokens),
            "trainer_affinity_during_generation": affinity,
        },
        "weight_sync_s": statistics.median(sync_s) if sync_s else None,
        "groups": groups,
    }


# ---------------------------------------------------------------------------- (b) training
def replay_batches(groups: list[list], prompts_per_step: int, n_batches: int) -> Iterator[list[list]]:
    """``n_batches`` rollout batches of P groups from ``groups``, cycling if there are too few."""
    if not groups:
        raise ValueError("no complete groups to train on")
    k = 0
    for _ in range(n_batches):
        batch = []
        for _ in range(prompts_per_step):
            batch.append(groups[k % len(groups)])
            k += 1
        yield batch


def measure_training(
    cfg: DictConfig, groups: list[list], warmup_batches: int, batches: int, shared: bool = False
) -> dict[str, Any]:
    """Samples/s of the GRPO module's training steps on replayed experiences, with no engine or
    (``shared``) with the engine generating meanwhile (then also its samples/s over the window)."""
    import lightning as L
    import torch
    from hydra.utils import instantiate
    from torch.utils.data import DataLoader, IterableDataset
    from transformers import AutoTokenizer

    from data.rollout.batches import minibatches, rollout_stats
    from modules.callbacks.step_timer import StepTimer

    L.seed_everything(cfg.seed, workers=True)
    torch.set_num_threads(cfg.torch_threads)
    engine = instantiate(cfg.engine)  # never started: used only to pin this process like training
    p, mb, ep = int(cfg.rollout.prompts_per_step), int(cfg.algo.minibatches), int(cfg.algo.epochs)
    pad_id = AutoTokenizer.from_pretrained(engine.model_path).pad_token_id
    rollout_batches = list(replay_batches(groups, p, warmup_batches + batches))
    steps_per_batch = mb * ep

    class Replay(L.LightningDataModule):
        """Rollout batches as RolloutDataModule streams them, from recorded experiences."""

        def train_dataloader(self) -> DataLoader:
            return DataLoader(_Stream(), batch_size=None, num_workers=0, collate_fn=lambda item: item)

    class _Stream(IterableDataset):
        def __iter__(self) -> Iterator[list[dict[str, Any]]]:
            rng = random.Random(cfg.seed)
            for rb in rollout_batches:
                exps = [e for grp in rb for e in grp]
                yield minibatches(exps, mb, ep, rng, pad_id, rollout_stats(exps), sync_after=False)

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.samples: list[int] = []

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            self.ends.append(time.perf_counter())
            self.samples.append(int(pl_module.current_batch["num_samples"]))

    clock = StepClock()
    timer = StepTimer()
    module = instantiate(cfg.module)
    background = BackgroundGeneration(cfg) if shared else contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="asyncrl-bound-") as tmp, background, engine.pinning:
        affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        trainer = instantiate(
            cfg.trainer,
            max_steps=len(rollout_batches) * steps_per_batch,
            devices=1,  # one trainer process: the bound of trainer.devices > 1 is not measured
            callbacks=[timer, clock],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp,
        )
        trainer.fit(module, datamodule=Replay())
    w = warmup_batches * steps_per_batch  # >= 1: the timed window starts at the end of step w
    seconds = clock.ends[-1] - clock.ends[w - 1]
    n = sum(clock.samples[w:])
    step_s = [b - a for a, b in zip(clock.ends[w - 1 :], clock.ends[w:])]
    lengths = [len(e.response_ids) for rb in rollout_batches[warmup_batches:] for grp in rb for e in grp]
    if shared:
        gen_rate = background.samples_per_s(clock.ends[w - 1], clock.ends[-1])
        return {"samples_per_s": n / seconds, "generation_samples_per_s": gen_rate, "seconds": seconds}
    return {
        "warmup_batches": warmup_batches,
        "batches": batches,
        "steps": len(clock.ends) - w,
        "samples": n,
        "seconds": seconds,
        "samples_per_s": n / seconds,
        "step_s_median": statistics.median(step_s) if step_s else None,
        # median seconds per phase over the timed steps (modules/callbacks/step_timer.py)
        "step_breakdown_s": {
            k: statistics.median(p[k] for p in list(timer.history)[w:]) for k in (*StepTimer.PHASES, "step")
        },
        "forward_layout": type(module.forward_logprobs).__name__,
        "response_len_mean": statistics.fmean(lengths),
        "minibatches": mb,
        "epochs": ep,
        "torch_threads": cfg.torch_threads,
        "trainer_affinity": affinity,
    }


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
