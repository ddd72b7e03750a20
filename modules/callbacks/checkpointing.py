"""Checkpoints besides Lightning's own: the HF model at the end, ``interrupted.ckpt`` on a signal.

python train.py ckpt_path=outputs/<recipe>/<time>/checkpoints/interrupted.ckpt   # resume
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch

from modules.policy.hf_policy import named_weights
from modules.policy.lora import is_lora
from modules.policy.sharding import full_weights, is_sharded

log = logging.getLogger(__name__)


class SaveHFModel(L.Callback):
    """At the end of training, write the policy with ``save_pretrained`` (loadable by vLLM)."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # FSDP: every rank gathers the full tensors; rank 0 writes them
        state = full_weights(pl_module.policy) if is_sharded(pl_module.policy) else None
        if trainer.global_rank != 0:
            return
        out = Path(self.dirpath)
        out.mkdir(parents=True, exist_ok=True)
        policy = pl_module.policy
        if is_lora(policy):  # the merged model (what the engine served), and the adapter alone
            policy.save_pretrained(out / "lora_adapter", safe_serialization=True)
            state, policy = named_weights(policy), policy.get_base_model()
        policy.save_pretrained(out, safe_serialization=True, state_dict=state)
        pl_module.tokenizer.save_pretrained(out)
        if pl_module.policy.generation_config is not None:
            pl_module.policy.generation_config.save_pretrained(out)


class CheckpointOnInterrupt(L.Callback):
    """On Ctrl-C or SIGTERM: write ``interrupted.ckpt``, so a scheduler can requeue and resume
    (``modules/launch/guard.py`` then exits 130 for Ctrl-C, 143 for SIGTERM).

    Written mid-step: the rollout batch in training is given back (its prompts re-queued, the
    staleness bound's count forgets it) while none of its optimizer steps has finished, else
    its remaining steps are saved and run first on resume (``data/rollout/handoff.py``)."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self._sigterm = False
        self._training = False  # interrupted before the loop (model load, engine start): nothing to save

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training = True
        # DDP: Lightning's SIGTERM handler broadcasts from inside the signal handler, which
        # collides with a collective the other ranks are blocked in (here: the scatter of the
        # next rollout batch), so a rank crashes and the run dies without a checkpoint. Only
        # record the signal here; on_train_batch_end shares rank 0's record with every rank,
        # and then all ranks stop at the same step through on_exception below.
        self._sigterm = False
        if trainer.world_size > 1 and threading.current_thread() is threading.main_thread():

            def note_sigterm(signum: int, frame: object) -> None:
                self._sigterm = True

            signal.signal(signal.SIGTERM, note_sigterm)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        if trainer.world_size == 1:
            return  # Lightning's own handler stops a single process
        import torch.distributed as dist

        flag = torch.tensor([int(self._sigterm)], device=pl_module.device)
        dist.broadcast(flag, src=0)
        if flag.item():
            trainer._signal_connector.received_sigterm = True  # Lightning raises after this hook

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        from modules.callbacks.interrupts import EXIT_CTRL_C, EXIT_SIGTERM, ctrl_c_received

        # A Ctrl-C can lose the race to its own echo: the engine core dies of the same SIGINT
        # and the step raises that error instead of KeyboardInterrupt (seen in CI under load).
        if isinstance(exception, KeyboardInterrupt) or ctrl_c_received():
            code = EXIT_CTRL_C
        elif isinstance(exception, SIGTERMException):
            code = EXIT_SIGTERM
        else:
            return
        if not self._training:
            print(f"interrupted (exit {code}) before training started: no checkpoint", flush=True)
            return
        sharded = is_sharded(pl_module.policy)
        if sharded and code != EXIT_SIGTERM:  # gathering FSDP shards needs every rank here
            print(f"interrupted (exit {code}); sharded state: no checkpoint written", flush=True)
            return
        if trainer.global_rank == 0 or sharded:  # FSDP: SIGTERM stops every rank at this step
            path = Path(self.dirpath) / "interrupted.ckpt"
            # Not trainer.save_checkpoint: its barrier would wait for DDP ranks that may not
            # have seen the signal. Rank 0 holds the full (replicated) state, so it writes alone.
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            if trainer.global_rank != 0:
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            trainer.strategy.checkpoint_io.save_checkpoint(checkpoint, path)
            print(f"interrupted (exit {code}); checkpoint written to {path}", flush=True)


def checkpoint_between_rollout_batches(cfg: Any) -> None:
    """Cross-field rule: a step-end checkpoint falls between rollout batches, or it would record
    a batch's prompts as consumed before all its minibatches trained."""
    from modules.config.errors import batch_shape, check

    shape = batch_shape(cfg)
    if shape is None:
        return
    steps = shape[2] * shape[3]
    every = (cfg.get("callbacks") or {}).get("checkpoint", {}).get("every_n_train_steps")
    check(
        "callbacks.checkpoint.every_n_train_steps",
        every,
        not every or every % steps == 0,
        f"a multiple of algo.minibatches * algo.epochs = {steps} (a checkpoint inside a rollout "
        "batch would record its prompts as consumed before all its minibatches trained)",
    )
