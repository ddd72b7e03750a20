"""Test-only callback for the DDP end-to-end test: what each rank ended with.

At train end (after ``WeightSync`` pushed the last update) every rank saves its policy
weights to ``weights.rank<r>.pt``; rank 0 also scores one sequence on the engine and writes
the largest engine-vs-trainer logprob difference to ``engine_diff.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch

from modules.callbacks.weight_sync import WeightSync


class DumpRankWeights(L.Callback):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        out = Path(trainer.default_root_dir)
        state = {k: v.detach().cpu().clone() for k, v in pl_module.policy.state_dict().items()}
        torch.save(state, out / f"weights.rank{trainer.global_rank}.pt")
        if trainer.global_rank == 0:
            batch = pl_module.current_batch  # the last trained minibatch
            probe = batch["input_ids"][0, : int(batch["attention_mask"][0].sum())].tolist()
            diff = WeightSync._max_diff(trainer, pl_module, probe)
            info = {"engine_max_abs_diff": diff, "engine_version": trainer.datamodule.engine.version}
            (out / "engine_diff.json").write_text(json.dumps(info))
