"""The training half of ``tools.bound``: the recipe's module training on experiences recorded by
the generation half, with no engine ((b)) or with the engine generating meanwhile ((c),
``--shared``).

Imported by ``tools.bound`` (run that: ``python -m tools.bound [overrides]``); what is measured
is in its docstring. Experiences in, samples/s and the per-step breakdown out.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig

from tools.bound_generation import BackgroundGeneration


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
