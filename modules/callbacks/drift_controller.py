"""Drift monitor and adaptive controller: act on ``modules.callbacks.drift_score`` alarms before reward collapses.

    python train.py callbacks/drift=monitor                          # score + alarms only
    python train.py recipe=async_grpo callbacks/drift=controller     # ... and act on them
    python train.py callbacks/drift=controller callbacks.weight_sync.lag=4   # controlled lag

Each optimizer step the callback logs ``train/grad_norm`` (before clipping), feeds the step's
metrics to the ``DriftDetector`` and logs ``drift/score``, ``drift/alarm`` and ``drift/z/<signal>``.
With ``actions`` it then acts on an alarm, one notch per action, at most once per ``cooldown``
steps:

* ``staleness``: halve the staleness bound (``rollout.max_staleness`` of a partial / streaming
  rollout, or the delayed sync's ``callbacks.weight_sync.lag``; 1 goes to 0). Less lag is the
  cause removed, at the price of throughput (more dropped or waited-for groups). Halving, not
  one version at a time: a run that alarms at K = 8 is typically still drifting at K = 7, and
  one notch per ``cooldown`` steps would take 40 steps to get to K = 0.
* ``lr``: multiply the learning rate by ``lr_factor`` (floor ``min_lr_scale`` of the configured
  rate). A smaller step keeps the current policy close to the behaviour policy whatever the lag.
* ``truncate``: cap the correction's weights (``Correction.limit``): an unbounded correction
  (``token_is``, ``seq_is``, ``geo_seq_is``) is capped at ``truncate_to``, a bounded one
  (``tis``'s cap, ``mis``'s / ``icepop``'s upper bound, ``Correction.max_weight``) has its
  bound halved, never below 1 (below 1 it would clip on-policy tokens, whose weight is 1).
  Trades the weights' variance for truncation bias, at no cost in throughput; only under the
  decoupled anchor (the bypass anchor's weights are <= 1) and where the bound is above 1. The
  ``is/*`` diagnostics, ESS included, then describe the capped weights the loss uses. Its
  notches are relaxed after all the others (a cap costs no throughput), one per relaxation.

After ``relax_after`` consecutive quiet steps (relative score below half the threshold, no
signal at its ceiling) it relaxes the most recent staleness or lr notch (caps last) by one step: the bound up by one
version (back towards its value before the cut, which is then done), the lr up by a
``lr_relax_steps``-th of its cut (x2^(1/4) per step for a halving): multiplicative
decrease, slow increase, as TCP does with its window (a relaxed lr that at once brings the
drift back undoes the rescue: measured, docs/estimators.md). Under a delayed sync the detector's
baseline waits until the lag has ramped up to K (its first K versions are less stale) unless
``baseline`` is ``first`` (learned from the first step, as it is in every run without a delayed
sync; with several optimizer steps per batch the ramp lasts K batches, and a collapse can begin
inside it); the absolute ceilings score from the first step. Skipped (non-finite) steps are not fed to it.
Every action is logged as ``controller/*`` metrics and on the console. The state (detector,
notches taken, the cap) is checkpointed; a resume whose ``actions`` no longer include
``truncate``, or whose loss has nothing to cap, drops the cap. Under DDP every rank sees the same reduced metrics and takes
the same decisions; only rank 0's rollout has a staleness bound to move.
"""

from __future__ import annotations

import logging
import math
import time

import lightning as L
import torch

from modules.algo.corrections import Correction
from modules.callbacks.drift_score import DriftDetector, DriftReading
from modules.callbacks.weight_sync import WeightSync
from modules.config.errors import check

log = logging.getLogger(__name__)

ACTIONS = ("staleness", "lr", "truncate")
BASELINES = ("ramp", "first")
MIN_TRUNCATION = 1.0


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
        lr_relax_steps: int = 4,
        truncate_to: float = 2.0,
        baseline: str = "ramp",
    ) -> None:
        actions = list(actions or [])
        check("callbacks.drift.baseline", baseline, baseline in BASELINES, f"one of {list(BASELINES)}")
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
        check(
            "callbacks.drift.lr_relax_steps",
            lr_relax_steps,
            isinstance(lr_relax_steps, int) and lr_relax_steps >= 1,
            "an int >= 1 (relaxations that undo one lr cut)",
        )
        check(
            "callbacks.drift.truncate_to",
            truncate_to,
            isinstance(truncate_to, (int, float))
            and not isinstance(truncate_to, bool)
            and math.isfinite(truncate_to)
            and truncate_to >= MIN_TRUNCATION,
            f"a finite float >= {MIN_TRUNCATION} (the first cap put on uncapped correction weights)",
        )
        self.baseline = baseline
        self.lr_relax_steps = lr_relax_steps
        self.truncate_to = float(truncate_to)
        self.detector = detector
        self.actions = actions
        self.lr_factor = lr_factor
        self.min_lr_scale = min_lr_scale
        self.cooldown = cooldown
        self.relax_after = relax_after
        self.lr_scale = 1.0
        # actions taken and not undone, most recent last:
        # ("lr", factor still to undo, step up per relaxation), ("staleness", bound before the
        # cut, bound the cut started from: the smaller when a loose bound came down to what the
        # run saw) or ("truncate", limit before the cut (inf: none), limit set). A
        # lr_relax_steps changed on resume applies to the next cut.
        self.notches: list[tuple[str, float, float]] = []
        self.bound: int | None = None  # the staleness bound as the controller left it (None: untouched)
        self.limit: float | None = None  # the correction's weight limit as the controller left it
        self.since_action = cooldown
        self.healthy = 0
        self.alarms = 0
        self.grad_norm: float | None = None
        self._busy_s = 0.0  # seconds the grad norm took this step
        self._lag_knob: WeightSync | None = None
        self._configured_bound: int | None = None
        self._observed_staleness: int | None = None
        self._ramp_done = True
        self._resumed_ramp_done = False

    # ------------------------------------------------------------------ the knobs
    def _bound(self, trainer: L.Trainer) -> int | None:
        """The staleness bound the staleness action moves: the delayed sync's lag when one is
        configured, else the rollout's ``max_staleness`` (None: sync rollout, nothing stale)."""
        if self._lag_knob is not None:
            return self._lag_knob.lag
        return trainer.datamodule.staleness_bound()

    def _set_bound(self, trainer: L.Trainer, value: int | None) -> None:
        self.bound = value
        if self._lag_knob is not None:
            self._lag_knob.lag = value
        else:
            trainer.datamodule.set_staleness_bound(value)

    @staticmethod
    def _correction(pl_module: L.LightningModule) -> Correction | None:
        """The correction whose weights ``truncate`` caps: None when they cannot exceed 1 (the
        bypass anchor, where pi_old := mu, or a bound <= 1) or the module has no policy loss
        (SFT)."""
        loss = getattr(pl_module, "loss_fn", None)  # SFTModule has none
        if loss is None or loss.anchor != "decoupled":
            return None
        bound = loss.correction.max_weight
        return loss.correction if bound is None or bound > MIN_TRUNCATION else None

    def _truncate(self, pl_module: L.LightningModule) -> str | None:
        correction = self._correction(pl_module)
        if correction is None:
            return None
        caps = [c for c in (correction.limit, correction.max_weight) if c is not None]
        now = min(caps) if caps else math.inf
        new = max(self.truncate_to if now == math.inf else now / 2, MIN_TRUNCATION)
        if new >= now - 1e-9:
            return None
        before = math.inf if correction.limit is None else correction.limit
        correction.limit = self.limit = new
        # truncate notches stay at the front of the list, in order: relaxed after every other
        self.notches.insert(sum(n[0] == "truncate" for n in self.notches), ("truncate", before, new))
        return f"correction weights capped at {new:.3g} (was {now:.3g})"

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Which knob, from the configured values; then re-apply a resumed run's bound (callback
        # state is restored before this hook; the lr scale lives in the optimizer's state).
        ws = next((c for c in trainer.callbacks if isinstance(c, WeightSync)), None)
        self._lag_knob = ws if ws is not None and ws.lag > 0 else None
        self._configured_bound = self._bound(trainer)
        # A delayed sync's lag ramps 0..K over its first K versions: no baseline from the ramp.
        self._ramp_done = self._lag_knob is None or self._resumed_ramp_done
        if self.bound is not None and self._configured_bound is not None:
            self._set_bound(trainer, self.bound)
        correction = self._correction(pl_module)
        if "truncate" not in self.actions or correction is None:  # nothing to cap now
            self.notches = [n for n in self.notches if n[0] != "truncate"]
            self.limit = None
        elif self.limit is not None:
            correction.limit = self.limit

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        t0 = time.perf_counter()
        norms = [p.grad.detach().norm(2) for p in pl_module.parameters() if p.grad is not None]
        self.grad_norm = float(torch.stack(norms).norm(2)) if norms else None
        self._busy_s = time.perf_counter() - t0

    def _observed(self, trainer: L.Trainer, pl_module: L.LightningModule, metrics: dict[str, float]) -> None:
        """The largest staleness any rank trained this step (the same on every rank)."""
        x = metrics.get("rollout/staleness_max")
        if x is None or not math.isfinite(x):
            return
        if trainer.world_size > 1:
            x = float(pl_module.all_gather(torch.tensor(x, device=pl_module.device)).max())
        self._observed_staleness = int(x)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object = None, *args: object
    ) -> None:
        t0 = time.perf_counter()
        grad_norm, self.grad_norm = self.grad_norm, None
        if outputs is None or grad_norm is None:
            return  # a skipped (non-finite) step: nothing was trained, the metrics are stale
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        metrics["train/grad_norm"] = grad_norm
        self._observed(trainer, pl_module, metrics)
        if not self._ramp_done:  # at the configured K: a lag the controller cut during the ramp
            # must relax back before a baseline is fitted, else K's own level would read as drift
            self._ramp_done = (self._observed_staleness or 0) >= (self._configured_bound or 0)
        values = {"train/grad_norm": grad_norm}
        reading = self.detector.update(metrics, learn=self._ramp_done or self.baseline == "first")
        values.update({"drift/score": reading.score, "drift/alarm": float(reading.alarm)})
        values.update({f"drift/z/{k}": v for k, v in reading.z.items()})
        self.alarms += int(reading.alarm)
        self.since_action += 1
        if self.actions:
            self._control(trainer, pl_module, reading)
            values["controller/lr_scale"] = self.lr_scale
            bound = self._bound(trainer)
            if bound is not None:
                values["controller/staleness_bound"] = float(bound)
            values["controller/notches"] = float(len(self.notches))
            if "truncate" in self.actions and self._correction(pl_module) is not None:
                values["controller/weight_limit"] = math.inf if self.limit is None else self.limit
        # the callback's own cost this step (grad norm + detector + controller), in milliseconds
        values["perf/drift_callback_ms"] = 1e3 * (self._busy_s + time.perf_counter() - t0)
        for k, v in values.items():
            pl_module.log(k, v, on_step=True, on_epoch=False, batch_size=1)

    def _control(self, trainer: L.Trainer, pl_module: L.LightningModule, reading: DriftReading) -> None:
        step = trainer.global_step
        if reading.alarm and self.since_action >= self.cooldown:
            done = []
            if "truncate" in self.actions:
                what = self._truncate(pl_module)
                if what:
                    done.append(what)
            if "staleness" in self.actions:
                before = self._bound(trainer)
                bound = before
                if bound is not None and self._observed_staleness is not None and self._lag_knob is None:
                    # a loose bound (partial rollout's default is unbounded) comes down to
                    # what the run actually sees first, else the cut would change nothing (a
                    # delayed sync's lag is exact: during its ramp the run sees less of it)
                    bound = min(bound, self._observed_staleness)
                if before is not None and bound is not None and 0 < bound < math.inf:
                    self._set_bound(trainer, bound // 2)
                    self.notches.append(("staleness", float(before), float(bound)))
                    done.append(f"staleness bound {before} -> {bound // 2}")
            # down by lr_factor, or to the floor when that is closer (a partly relaxed scale)
            cut = max(self.lr_scale * self.lr_factor, self.min_lr_scale) / self.lr_scale
            if "lr" in self.actions and cut < 1 - 1e-9:
                scale_learning_rate(trainer, cut)
                self.lr_scale *= cut
                self.notches.append(("lr", cut, cut ** (-1 / self.lr_relax_steps)))
                done.append(f"lr x{cut:.3g} (now {self.lr_scale:.3g} of configured)")
            if done:
                self.since_action = 0
                log.warning(
                    "drift alarm at step %d (score %.1f, driven by %s): %s",
                    step,
                    reading.score,
                    reading.driver,
                    "; ".join(done),
                )
            self.healthy = 0
            return
        # quiet: the relative score well below the threshold and no signal at its ceiling (a
        # steady clip fraction at half its ceiling is healthy, not a reason to stay cut)
        quiet = reading.relative < self.detector.threshold / 2 and reading.ceiling < self.detector.threshold
        self.healthy = self.healthy + 1 if quiet else 0
        if self.healthy >= self.relax_after and self.notches:
            kind, value, start = self.notches[-1]
            if kind == "lr":  # ("lr", factor still to undo, step up): geometric, the last step exact
                up = min(start, 1 / value)
                if value * up >= 1 - 1e-9:
                    self.notches.pop()
                else:
                    self.notches[-1] = (kind, value * up, start)
                scale_learning_rate(trainer, up)
                self.lr_scale *= up
                what = f"lr up to {self.lr_scale:.3g} of configured"
            elif kind == "truncate":  # ("truncate", limit before, limit set): one step back
                self.limit = None if value == math.inf else value
                correction = self._correction(pl_module)
                if correction is not None:
                    correction.limit = self.limit
                self.notches.pop()
                what = (
                    "correction weights uncapped"
                    if self.limit is None
                    else f"weight cap up to {self.limit:.3g}"
                )
            else:
                now = self._bound(trainer)
                new = (now or 0) + 1
                if new >= int(start):  # back where the cut started: the notch is undone
                    new = None if value == math.inf else int(value)  # inf: unbounded again
                    self.notches.pop()
                self._set_bound(trainer, new)
                what = f"staleness bound {now} -> {new}"
            self.healthy = 0
            self.since_action = 0
            log.warning("drift quiet for %d steps at step %d: %s", self.relax_after, step, what)

    def _notch(self, n: list) -> tuple[str, float, float]:
        """A checkpointed notch; older ones were (kind, value) or ("lr", factor, 0.0)."""
        kind, value = str(n[0]), float(n[1])
        third = float(n[2]) if len(n) > 2 else None
        if kind == "lr":  # ("lr", factor still to undo, step up > 1)
            return kind, value, third if third and third > 1 else value ** (-1 / self.lr_relax_steps)
        # staleness without where its cut started: the next relaxation restores the value
        return kind, value, third if third is not None else float((self.bound or 0) + 1)

    def state_dict(self) -> dict[str, object]:
        return {
            "detector": self.detector.state_dict(),
            "lr_scale": self.lr_scale,
            "bound": self.bound,
            "limit": self.limit,
            "notches": [list(n) for n in self.notches],
            "since_action": self.since_action,
            "healthy": self.healthy,
            "alarms": self.alarms,
            "ramp_done": self._ramp_done,
        }

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        self.detector.load_state_dict(state_dict["detector"])  # type: ignore[arg-type]
        self.lr_scale = float(state_dict["lr_scale"])  # type: ignore[arg-type]
        bound = state_dict["bound"]
        self.bound = None if bound is None else int(bound)  # type: ignore[arg-type]
        limit = state_dict.get("limit")
        self.limit = None if limit is None else float(limit)  # type: ignore[arg-type]
        self.notches = [self._notch(n) for n in state_dict["notches"]]  # type: ignore[union-attr]
        self.since_action = int(state_dict["since_action"])  # type: ignore[arg-type]
        self.healthy = int(state_dict["healthy"])  # type: ignore[arg-type]
        self.alarms = int(state_dict["alarms"])  # type: ignore[arg-type]
        self._resumed_ramp_done = bool(state_dict.get("ramp_done", self.detector.steps > 0))
