"""Drift monitor and adaptive controller: act on ``modules.drift`` alarms before reward collapses.

    python train.py callbacks/drift=monitor                          # score + alarms only
    python train.py recipe=async_grpo callbacks/drift=controller     # ... and act on them
    python train.py callbacks/drift=controller callbacks.weight_sync.lag=4   # controlled lag

Each optimizer step the callback logs ``train/grad_norm`` (before clipping), feeds the step's
metrics to the ``DriftDetector`` and logs ``drift/score``, ``drift/alarm`` and ``drift/z/<signal>``.
With ``actions`` it then acts on an alarm, one notch per action, at most once per ``cooldown``
steps:

* ``staleness``: lower the staleness bound by one version: ``rollout.max_staleness`` of a
  partial / streaming rollout, or the delayed sync's ``callbacks.weight_sync.lag`` (floor 0).
  Less lag is the cause removed, at the price of throughput (more dropped or waited-for groups).
* ``lr``: multiply the learning rate by ``lr_factor`` (floor ``min_lr_scale`` of the configured
  rate). A smaller step keeps the current policy close to the behaviour policy whatever the lag.

After ``relax_after`` consecutive steps with the score below half the threshold it undoes the
most recent notch (a smaller lr first goes back up, then the bound), so a passing spike costs
little. Every action is logged as ``controller/*`` metrics and on the console. The state
(detector baseline, notches taken) is checkpointed. Under DDP every rank sees the same reduced
metrics and takes the same decisions; only rank 0's rollout has a staleness bound to move.
"""

from __future__ import annotations

import logging
import math

import lightning as L
import torch

from modules.callbacks import WeightSync
from modules.config_errors import check
from modules.drift import DriftDetector

log = logging.getLogger(__name__)

ACTIONS = ("staleness", "lr")


def scale_learning_rate(trainer: L.Trainer, factor: float) -> None:
    """Multiply every param group's lr by ``factor``, and the schedulers' base rates, so a
    per-step schedule (``LambdaLR``) keeps the new scale instead of overwriting it."""
    for opt in trainer.optimizers:
        for group in opt.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
    for config in trainer.lr_scheduler_configs:
        base = getattr(config.scheduler, "base_lrs", None)
        if base is not None:
            config.scheduler.base_lrs = [b * factor for b in base]


class DriftCallback(L.Callback):
    def __init__(
        self,
        detector: DriftDetector,
        actions: list[str] | tuple[str, ...] = (),
        lr_factor: float = 0.5,
        min_lr_scale: float = 0.125,
        cooldown: int = 5,
        relax_after: int = 20,
    ) -> None:
        actions = list(actions or [])
        for a in actions:
            check("callbacks.drift.actions", actions, a in ACTIONS, f"a list drawn from {list(ACTIONS)}")
        check("callbacks.drift.lr_factor", lr_factor, 0 < lr_factor < 1, "a float in (0, 1)")
        check("callbacks.drift.min_lr_scale", min_lr_scale, 0 < min_lr_scale <= 1, "a float in (0, 1]")
        check(
            "callbacks.drift.cooldown", cooldown, isinstance(cooldown, int) and cooldown >= 1, "an int >= 1"
        )
        check(
            "callbacks.drift.relax_after",
            relax_after,
            isinstance(relax_after, int) and relax_after >= 1,
            "an int >= 1 (healthy steps before a notch is undone)",
        )
        self.detector = detector
        self.actions = actions
        self.lr_factor = lr_factor
        self.min_lr_scale = min_lr_scale
        self.cooldown = cooldown
        self.relax_after = relax_after
        self.lr_scale = 1.0
        self.staleness_cut = 0  # versions taken off the configured bound
        self.notches: list[str] = []  # actions taken and not undone, most recent last
        self.since_action = cooldown
        self.healthy = 0
        self.alarms = 0
        self.grad_norm: float | None = None
        self._lag_knob: WeightSync | None = None
        self._observed_staleness: int | None = None

    # ------------------------------------------------------------------ the knobs
    def _bound(self, trainer: L.Trainer) -> int | None:
        """The staleness bound the staleness action moves: the delayed sync's lag when one is
        configured, else the rollout's ``max_staleness`` (None: sync rollout, nothing stale)."""
        if self._lag_knob is not None:
            return self._lag_knob.lag
        return trainer.datamodule.staleness_bound()

    def _set_bound(self, trainer: L.Trainer, value: int) -> None:
        if self._lag_knob is not None:
            self._lag_knob.lag = value
        else:
            trainer.datamodule.set_staleness_bound(value)

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Which knob, from the configured values; then re-apply a resumed run's cut (callback
        # state is restored before this hook; the lr scale lives in the optimizer's state).
        ws = next((c for c in trainer.callbacks if isinstance(c, WeightSync)), None)
        self._lag_knob = ws if ws is not None and ws.lag > 0 else None
        bound = self._bound(trainer)
        if self.staleness_cut and bound is not None:
            self._set_bound(trainer, max(bound - self.staleness_cut, 0))

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        norms = [p.grad.detach().norm(2) for p in pl_module.parameters() if p.grad is not None]
        self.grad_norm = float(torch.stack(norms).norm(2)) if norms else 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        if self.grad_norm is not None:
            metrics["train/grad_norm"] = self.grad_norm
            pl_module.log("train/grad_norm", self.grad_norm, on_step=True, on_epoch=False, batch_size=1)
        self.grad_norm = None
        if "rollout/staleness_max" in metrics and math.isfinite(metrics["rollout/staleness_max"]):
            self._observed_staleness = int(metrics["rollout/staleness_max"])
        reading = self.detector.update(metrics)
        values = {"drift/score": reading.score, "drift/alarm": float(reading.alarm)}
        values.update({f"drift/z/{k}": v for k, v in reading.z.items()})
        self.alarms += int(reading.alarm)
        self.since_action += 1
        if self.actions:
            self._control(trainer, pl_module, reading)
            values["controller/lr_scale"] = self.lr_scale
            values["controller/staleness_cut"] = float(self.staleness_cut)
            bound = self._bound(trainer)
            if bound is not None:
                values["controller/staleness_bound"] = float(bound)
            values["controller/notches"] = float(len(self.notches))
        for k, v in values.items():
            pl_module.log(k, v, on_step=True, on_epoch=False, batch_size=1)

    def _control(self, trainer: L.Trainer, pl_module: L.LightningModule, reading: object) -> None:
        score, alarm = reading.score, reading.alarm  # type: ignore[attr-defined]
        step = trainer.global_step
        if alarm and self.since_action >= self.cooldown:
            done = []
            if "staleness" in self.actions:
                bound = self._bound(trainer)
                if bound is not None and self._observed_staleness is not None:
                    # a loose bound (partial rollout's default is unbounded) comes down to
                    # what the run actually sees first, else the cut would change nothing
                    bound = min(bound, self._observed_staleness)
                if bound is not None and bound > 0:
                    before = self._bound(trainer)
                    self._set_bound(trainer, bound - 1)
                    self.staleness_cut += before - (bound - 1)
                    self.notches.append("staleness")
                    done.append(f"staleness bound {before} -> {bound - 1}")
            if "lr" in self.actions and self.lr_scale * self.lr_factor >= self.min_lr_scale - 1e-12:
                scale_learning_rate(trainer, self.lr_factor)
                self.lr_scale *= self.lr_factor
                self.notches.append("lr")
                done.append(f"lr x{self.lr_factor:g} (now {self.lr_scale:g} of configured)")
            if done:
                self.since_action = 0
                log.warning(
                    "drift alarm at step %d (score %.1f, driven by %s): %s",
                    step,
                    score,
                    reading.driver,
                    "; ".join(done),  # type: ignore[attr-defined]
                )
            self.healthy = 0
            return
        self.healthy = self.healthy + 1 if math.isfinite(score) and score < self.detector.threshold / 2 else 0
        if self.healthy >= self.relax_after and self.notches:
            undo = self.notches.pop()
            if undo == "lr":
                scale_learning_rate(trainer, 1 / self.lr_factor)
                self.lr_scale /= self.lr_factor
                what = f"lr back to {self.lr_scale:g} of configured"
            else:
                bound = self._bound(trainer) or 0
                self._set_bound(trainer, bound + 1)
                self.staleness_cut = max(self.staleness_cut - 1, 0)
                what = f"staleness bound {bound} -> {bound + 1}"
            self.healthy = 0
            self.since_action = 0
            log.warning("drift quiet for %d steps at step %d: %s", self.relax_after, step, what)

    def state_dict(self) -> dict[str, object]:
        return {
            "detector": self.detector.state_dict(),
            "lr_scale": self.lr_scale,
            "staleness_cut": self.staleness_cut,
            "notches": list(self.notches),
            "since_action": self.since_action,
            "healthy": self.healthy,
            "alarms": self.alarms,
        }

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        self.detector.load_state_dict(state_dict["detector"])  # type: ignore[arg-type]
        self.lr_scale = float(state_dict["lr_scale"])  # type: ignore[arg-type]
        self.staleness_cut = int(state_dict["staleness_cut"])  # type: ignore[arg-type]
        self.notches = list(state_dict["notches"])  # type: ignore[arg-type]
        self.since_action = int(state_dict["since_action"])  # type: ignore[arg-type]
        self.healthy = int(state_dict["healthy"])  # type: ignore[arg-type]
        self.alarms = int(state_dict["alarms"])  # type: ignore[arg-type]
