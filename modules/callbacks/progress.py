"""The console's progress bar: optimizer steps out of ``trainer.max_steps``.

The RL recipes train on one endless stream (``max_epochs: -1``, stopped by ``max_steps``), so
Lightning's own bar reads "Epoch 0/-2" and counts batches of an epoch that never ends. This one
reads "step 12/60" (``trainer.global_step`` of ``trainer.max_steps``; after a resume it starts
where the checkpoint left off). Epoch-bounded runs (``max_steps: -1``) keep Lightning's bar.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

LOG_WIDTH = 200  # columns of the bar when the console is a file or a pipe (`make train | tee`)


class StepProgressBar(RichProgressBar):
    """Rich progress bar of optimizer steps (the project's default bar, conf/callbacks/*.yaml)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not sys.stdout.isatty():  # a log file gets the final bar alone: on one line, not wrapped at 80
            self._console_kwargs.setdefault("width", LOG_WIDTH)

    def _by_steps(self) -> bool:
        return self.trainer.max_steps is not None and self.trainer.max_steps > 0

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self._by_steps() else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        return "step" if self._by_steps() else super()._get_train_description(current_epoch)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._by_steps():
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()  # resumed mid-epoch
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()
