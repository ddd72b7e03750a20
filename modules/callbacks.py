"""Small Lightning callbacks shared by the recipes."""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path

import lightning as L
import torch

from modules.lora import is_lora
from modules.policy import named_weights
from modules.sharding import full_weights, is_sharded
from modules.weight_sync import WeightSync

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


class EngineStats(L.Callback):
    """The engine's ``perf/engine_idle_frac`` and ``perf/tokens_per_s`` (since it started),
    logged after every optimizer step (rank 0 owns the engine; the other ranks log nothing)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        for key, value in trainer.datamodule.engine_stats().items():
            pl_module.log(key, value, on_step=True, on_epoch=False, batch_size=1)


def before_after(first: dict[str, float], last: dict[str, float]) -> list[str]:
    """'held-out sampled reward 0.312 -> 0.561 (level0 0.52 -> 0.83, ...)' lines for the log."""
    lines = []
    for key, name in (
        ("sampled_reward", "sampled reward"),
        ("reward", "greedy reward"),
        ("sampled_exact", "sampled exact match"),
    ):
        if f"eval/{key}_mean" not in first or f"eval/{key}_mean" not in last:
            continue
        levels = sorted(k for k in first if k.startswith(f"eval/{key}_level") and k in last)
        per_level = ", ".join(f"{k.rsplit('_', 1)[1]} {first[k]:.2f} -> {last[k]:.2f}" for k in levels)
        lines.append(
            f"held-out {name} {first[f'eval/{key}_mean']:.3f} -> {last[f'eval/{key}_mean']:.3f}"
            + (f" ({per_level})" if per_level else "")
            + f" at policy version {first.get('policy_version', 0):.0f} -> {last.get('policy_version', 0):.0f}"
        )
    return lines


class HeldOutEval(L.Callback):
    """Greedy held-out reward from the engine: at start, every N policy versions, at the end.

    Counting policy versions (weight syncs), not optimizer steps, means the engine always
    evaluates the weights the trainer has (under a delayed sync, the ones it serves: the
    record's ``policy_version`` says which). Writes ``eval/*`` to the loggers and
    ``eval_summary.json`` (first, last and all evaluations) in the run directory.
    Must come after ``WeightSync`` in the callback list.
    """

    def __init__(self, every_n_versions: int = 20) -> None:
        self.every_n_versions = every_n_versions
        self.history: list[dict[str, float]] = []

    def _run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        metrics = trainer.datamodule.evaluate()
        if not metrics:
            return
        metrics["step"] = trainer.global_step
        metrics["policy_version"] = self._engine_version(trainer, pl_module)
        self.history.append(metrics)
        for logger in trainer.loggers:
            logger.log_metrics(
                {k: v for k, v in metrics.items() if k.startswith("eval/")}, step=trainer.global_step
            )
        for k, v in metrics.items():
            if k.startswith("eval/"):
                trainer.callback_metrics[k] = torch.tensor(v)
        # default_root_dir, not trainer.log_dir: under DDP the latter is a collective call,
        # and only rank 0 gets here
        out = {"first": self.history[0], "last": self.history[-1], "history": self.history}
        Path(trainer.default_root_dir, "eval_summary.json").write_text(json.dumps(out, indent=1))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._run(trainer, pl_module)

    @staticmethod
    def _engine_version(trainer: L.Trainer, pl_module: L.LightningModule) -> int:
        """The version the engine serves (behind the trainer's under a delayed sync)."""
        ws = next((c for c in trainer.callbacks if isinstance(c, WeightSync)), None)
        if ws is not None and ws.served_version is not None:
            return ws.served_version
        return pl_module.policy_version

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        version = self._engine_version(trainer, pl_module)
        if self.every_n_versions and version % self.every_n_versions == 0 and version != self._last_version():
            self._run(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._engine_version(trainer, pl_module) != self._last_version():
            self._run(trainer, pl_module)
        if trainer.global_rank == 0 and len(self.history) > 1:
            for line in before_after(self.history[0], self.history[-1]):
                log.info(line)

    def _last_version(self) -> int:
        return int(self.history[-1]["policy_version"]) if self.history else -1


class CheckpointOnInterrupt(L.Callback):
    """On Ctrl-C or SIGTERM: write ``interrupted.ckpt``, so a scheduler can requeue and resume
    (``modules/guard.py`` then exits 130 for Ctrl-C, 143 for SIGTERM)."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self._sigterm = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
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

        from modules.guard import EXIT_CTRL_C, EXIT_SIGTERM, ctrl_c_received

        # A Ctrl-C can lose the race to its own echo: the engine core dies of the same SIGINT
        # and the step raises that error instead of KeyboardInterrupt (seen in CI under load).
        if isinstance(exception, KeyboardInterrupt) or ctrl_c_received():
            code = EXIT_CTRL_C
        elif isinstance(exception, SIGTERMException):
            code = EXIT_SIGTERM
        else:
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
