"""Where an optimizer step's wall time goes, logged as ``perf/step_*`` after every step.

    python train.py callbacks.step_timer.sync=true   # exact per-phase times on a GPU
    make report RUN=outputs/sync_grpo/<time>          # the breakdown is the report's last panel

One optimizer step, from the end of the previous one:

    gap       previous step's end -> this step's start: the weight sync + engine verify, the
              held-out evaluation, checkpointing and Lightning's bookkeeping of that step
    wait      waiting for the rollout batch (only on a rollout batch's first step)
    prepare   the pi_old / recompute / KL-reward passes (same)
    forward   the training forward pass and the loss (up to reading the loss back, so on a
              GPU it holds the forward's kernels, not just their launch)
    overhead  the rest of the training step (metric logging), zero_grad (Lightning runs it
              between the training step and backward) and Lightning's hooks
    backward  autograd
    optimizer gradient clipping, the optimizer step, a per-step lr scheduler

``perf/step_s`` is their sum (the step's share of wall time). The weight sync itself is also
logged as ``perf/weight_sync_s`` and the engine's verify pass as ``perf/weight_verify_s``. On a
GPU, pass ``sync=true`` so each boundary waits for queued kernels (otherwise the time of an
asynchronous kernel lands in whichever phase next synchronises).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import lightning as L
import torch


class StepTimer(L.Callback):
    PHASES = ("gap", "wait", "prepare", "forward", "overhead", "backward", "optimizer")

    def __init__(self, sync: bool = False) -> None:
        self.sync = sync
        self.history: deque[dict[str, float]] = deque(maxlen=100_000)  # for benchmarks
        self._end: float | None = None
        self._start = self._bwd0 = self._bwd1 = 0.0

    def _now(self, pl_module: L.LightningModule) -> float:
        if self.sync and pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._start = self._now(pl_module)
        if self._end is None:
            self._end = self._start
        self._bwd0 = self._bwd1 = 0.0

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        self._bwd0 = self._now(pl_module)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._bwd1 = self._now(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        end = self._now(pl_module)
        inside = getattr(pl_module, "step_times", {}) or {}
        if self._bwd1:  # a skipped (non-finite) step has no backward and no optimizer step
            before_backward, backward, optimizer = (
                self._bwd0 - self._start,
                self._bwd1 - self._bwd0,
                end - self._bwd1,
            )
        else:
            before_backward, backward, optimizer = end - self._start, 0.0, 0.0
        parts = {
            "gap": self._start - (self._end if self._end is not None else self._start),
            "wait": inside.get("wait", 0.0),
            "prepare": inside.get("prepare", 0.0),
            "forward": inside.get("forward", 0.0),
            "backward": backward,
            "optimizer": optimizer,
        }
        parts["overhead"] = max(before_backward - parts["wait"] - parts["prepare"] - parts["forward"], 0.0)
        parts["step"] = end - (self._end if self._end is not None else self._start)
        self._end = end
        self.history.append(parts)
        for name, value in parts.items():
            key = "perf/step_s" if name == "step" else f"perf/step_{name}_s"
            pl_module.log(key, value, on_step=True, on_epoch=False, batch_size=1)
