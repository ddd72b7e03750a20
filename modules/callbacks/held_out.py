"""Held-out evaluation and engine statistics: the callbacks that report how the policy is doing.

python train.py callbacks.eval.every_n_versions=5    # greedy + sampled held-out reward every 5 versions
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning as L
import torch

from modules.callbacks.weight_sync import WeightSync
from modules.config.errors import check

log = logging.getLogger(__name__)


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


def framed(lines: list[str]) -> str:
    """``lines`` in a box, so that they stand out as the last lines of the console."""
    width = max(len(line) for line in lines)
    rule = "─" * (width + 2)
    return "\n".join([f"┌{rule}┐", *(f"│ {line:<{width}} │" for line in lines), f"└{rule}┘"])


def held_out_summary(trainer: L.Trainer) -> str | None:
    """The framed before -> after lines of the trainer's ``HeldOutEval``, if it evaluated twice."""
    evals = [c for c in trainer.callbacks if isinstance(c, HeldOutEval) and c.summary]
    return framed(evals[0].summary) if evals else None


class HeldOutEval(L.Callback):
    """Greedy held-out reward from the engine: at start, every N policy versions, at the end.

    Counting policy versions (weight syncs), not optimizer steps, means the engine always
    evaluates the weights the trainer has (under a delayed sync, the ones it serves: the
    record's ``policy_version`` says which). Writes ``eval/*`` to the loggers and
    ``eval_summary.json`` (first, last and all evaluations) in the run directory.
    Must come after ``WeightSync`` in the callback list.
    """

    def __init__(self, every_n_versions: int = 20) -> None:
        check(
            "callbacks.eval.every_n_versions",
            every_n_versions,
            isinstance(every_n_versions, int) and every_n_versions >= 0,
            "an int >= 0 (0 = never)",
        )
        self.every_n_versions = every_n_versions
        self.history: list[dict[str, float]] = []
        self.summary: list[str] = []  # the before -> after lines, at the end of fit (rank 0)

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
            self.summary = before_after(self.history[0], self.history[-1])  # train.py prints it last
        if trainer.global_rank == 0:  # the run shuts down next (checkpoint, engine stop)
            log.info("final held-out evaluation done (%d in all); shutting down", len(self.history))

    def _last_version(self) -> int:
        return int(self.history[-1]["policy_version"]) if self.history else -1
