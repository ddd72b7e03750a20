"""A drift score from the run's own diagnostics: does the off-policy estimator start to drift?

    python train.py callbacks/drift=monitor      # log drift/score and alarms, act on nothing
    python train.py callbacks/drift=controller   # ... and act on them (modules/callbacks/drift_controller.py)

Pure and stream-based: ``DriftDetector.update(metrics)`` takes one optimizer step's metrics and
returns a ``DriftReading``. No framework offers this; verl, AReaL, TRL, PRIME-RL and slime fix
the staleness bound and the correction up front and only log the diagnostics.

How the score is built (and why not a fixed threshold per metric): the diagnostics' healthy
levels depend on the task, the lag, the correction and the learning rate (``kl_behavior`` is
~1e-3 at staleness 0 and an order of magnitude higher at K = 4 on the default task), so each
signal is compared with *its own* level over the first ``warmup`` steps of the run:

* each signal is put on a scale where drift is additive (``log`` for positive, heavy-tailed
  ones such as the behaviour KL or the gradient norm), and oriented so that rising is bad
  (``direction=-1`` flips the ESS fraction, which falls when weights degenerate);
* the first ``skip`` learning steps are left out of the relative score (``update(learn=False)``
  steps, e.g. while a delayed sync's lag ramps up to K, do not count and are left out too);
* the baseline is the warm-up median and a robust spread (1.4826 x MAD, floored at
  ``min_scale`` so a flat warm-up does not turn noise into alarms);
* z_t = direction * (x_t - median) / spread, smoothed by an EWMA (``alpha``) so one noisy batch
  does not alarm;
* the score is the largest smoothed z over the signals present; an alarm is ``patience``
  consecutive steps with score > ``threshold``. The signal that drove it is named.

A relative score alone misses a run that is off-policy from its first steps (a lag or a
learning rate too large from the start): its warm-up *is* the drift, and the baseline learns it
as normal. Measured on the testbed at lr 1e-2 and K = 8 (``docs/estimators.md``): the behaviour
KL was 0.2-9 nats/token from step 1, the relative score first alarmed at step 31, 13 steps after
the collapse began. So signals may also carry an absolute **ceiling** (a floor for
``direction=-1``), active from the first step, warm-up and lag ramp included: the EWMA of the
raw value (same ``alpha``) scores ``threshold * level / ceiling`` (``threshold * floor / level``),
i.e. it reaches the threshold when the smoothed signal reaches its ceiling. The defaults are
trust-region sizes, not fits: a behaviour KL of 0.2 nats/token is a typical log-ratio of about
0.6, three times PPO's clip range log(1.2); a fifth of the tokens clipped means the update is no
longer inside the trust region it claims.

Signals missing from a step (e.g. ``is/ess_frac`` without a correction) are skipped, so one
detector serves every configuration. NaN / inf values count as the worst case (z = threshold *
2): a non-finite diagnostic is itself drift.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from modules.launch.config_errors import check


@dataclass(frozen=True)
class Signal:
    """One diagnostic: the metric ``key``, ``direction`` (+1: rising is bad, -1: falling is
    bad) and ``log`` (compare log values: for positive, multiplicative quantities)."""

    key: str
    direction: int = 1
    log: bool = False
    min_scale: float = 0.05
    floor: float = 1e-12  # log signals: values below count as this (float noise around 0)
    ceiling: float | None = None  # absolute limit of the smoothed raw value (a floor if direction=-1)

    def value(self, x: float) -> float:
        return math.log(max(x, self.floor)) if self.log else x

    def over_ceiling(self, level: float, threshold: float) -> float:
        """``threshold`` x how far the smoothed raw value is towards its ceiling (0: no ceiling)."""
        if self.ceiling is None:
            return 0.0
        if self.direction > 0:
            return threshold * max(level, 0.0) / self.ceiling
        return threshold * self.ceiling / max(level, 1e-12)


# What an off-policy estimator going wrong looks like in the metrics the run already logs.
DEFAULT_SIGNALS = (
    # KL(mu || pi): how far pi moved from mu. On-policy it is float noise (+-1e-8, either sign):
    # the floor keeps that noise from looking like orders of magnitude of drift.
    Signal("train/kl_behavior", 1, log=True, min_scale=0.25, floor=1e-6, ceiling=0.2),
    # share of tokens the trust region clips
    Signal("train/clip_frac", 1, log=False, min_scale=0.02, ceiling=0.2),
    Signal("train/grad_norm", 1, log=True, min_scale=0.25),  # before clipping
    # effective sample size / n of the IS weights: below a tenth, ten samples carry the batch
    Signal("is/ess_frac", -1, log=False, min_scale=0.02, ceiling=0.1),
    Signal("mismatch/k3", 1, log=True, min_scale=0.25, floor=1e-6),  # KL(mu || pi_old) of the stale samples
)


@dataclass
class DriftReading:
    step: int
    score: float  # max over signals of the smoothed z or the ceiling score (ceilings only in warm-up)
    alarm: bool  # patience consecutive steps over threshold
    driver: str | None  # the signal with the largest z
    z: dict[str, float] = field(default_factory=dict)
    relative: float = 0.0  # the largest smoothed z against the baselines (0 before they exist)
    ceiling: float = 0.0  # the largest ceiling score (threshold at a ceiling)


class DriftDetector:
    def __init__(
        self,
        signals: tuple[Signal, ...] | list[Signal] = DEFAULT_SIGNALS,
        warmup: int = 10,
        threshold: float = 4.0,
        patience: int = 2,
        alpha: float = 0.3,
        skip: int = 0,
    ) -> None:
        check(
            "callbacks.drift.detector.warmup", warmup, isinstance(warmup, int) and warmup >= 3, "an int >= 3"
        )
        check("callbacks.drift.detector.threshold", threshold, threshold > 0, "a float > 0 (robust z units)")
        check(
            "callbacks.drift.detector.patience",
            patience,
            isinstance(patience, int) and patience >= 1,
            "an int >= 1",
        )
        check(
            "callbacks.drift.detector.alpha",
            alpha,
            0 < alpha <= 1,
            "a float in (0, 1] (EWMA weight of a new step)",
        )
        check("callbacks.drift.detector.signals", list(signals), len(signals) > 0, "at least one signal")
        check("callbacks.drift.detector.skip", skip, isinstance(skip, int) and skip >= 0, "an int >= 0")
        for sig in signals:
            check(
                f"callbacks.drift.detector.signals[{sig.key}].ceiling",
                sig.ceiling,
                sig.ceiling is None or sig.ceiling > 0,
                "null or a float > 0",
            )
        self.signals = tuple(signals)
        self.warmup = warmup
        self.threshold = threshold
        self.patience = patience
        self.alpha = alpha
        self.skip = skip
        self.history: dict[str, list[float]] = {s.key: [] for s in self.signals}
        self.baseline: dict[str, tuple[float, float]] = {}
        self.smoothed: dict[str, float] = {}
        self.level: dict[str, float] = {}  # EWMA of the raw values of signals with a ceiling
        self.steps = 0
        self.learned = 0  # steps fed with learn=True
        self.over = 0  # consecutive steps above threshold

    def _z(self, sig: Signal, x: float) -> float:
        if not math.isfinite(x):
            return 2 * self.threshold
        med, scale = self.baseline[sig.key]
        return sig.direction * (sig.value(x) - med) / scale

    def _fit(self, sig: Signal) -> None:
        values = self.history[sig.key]
        med = statistics.median(values)
        mad = statistics.median(abs(v - med) for v in values)
        self.baseline[sig.key] = (med, max(1.4826 * mad, sig.min_scale))

    def _ema(self, table: dict[str, float], key: str, x: float, first: float | None = None) -> float:
        prev = table.get(key, x if first is None else first)
        table[key] = x if not math.isfinite(prev) else (1 - self.alpha) * prev + self.alpha * x
        return table[key]

    def update(self, metrics: dict[str, float], learn: bool = True) -> DriftReading:
        """Score one step. ``learn=False``: the step is not part of the baseline (a lag ramp)
        and the relative score is not computed; the ceilings still are."""
        step = self.steps
        self.steps += 1
        learned = self.learned  # steps fed with learn=True before this one: ``skip`` counts these
        self.learned += int(learn)
        z: dict[str, float] = {}
        rel: dict[str, float] = {}
        cap: dict[str, float] = {}
        for sig in self.signals:
            if sig.key not in metrics:
                continue
            x = float(metrics[sig.key])
            if sig.ceiling is not None:
                cap[sig.key] = (
                    sig.over_ceiling(self._ema(self.level, sig.key, x), self.threshold)
                    if math.isfinite(x)
                    else 2 * self.threshold
                )
            if not learn or learned < self.skip:
                continue
            if sig.key not in self.baseline:
                if math.isfinite(x):
                    self.history[sig.key].append(sig.value(x))
                if len(self.history[sig.key]) >= self.warmup:
                    self._fit(sig)
                continue
            rel[sig.key] = self._ema(self.smoothed, sig.key, self._z(sig, x), first=0.0)
        for key in {**rel, **cap}:
            z[key] = max(rel.get(key, -math.inf), cap.get(key, -math.inf))
        score = max(z.values(), default=0.0)
        self.over = self.over + 1 if score > self.threshold else 0
        driver = max(z, key=z.get) if z else None  # type: ignore[arg-type]
        return DriftReading(
            step,
            score,
            self.over >= self.patience,
            driver,
            z,
            relative=max(rel.values(), default=0.0),
            ceiling=max(cap.values(), default=0.0),
        )

    def state_dict(self) -> dict[str, object]:
        return {
            "history": self.history,
            "baseline": self.baseline,
            "smoothed": self.smoothed,
            "level": self.level,
            "steps": self.steps,
            "learned": self.learned,
            "over": self.over,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.history = {k: list(v) for k, v in state["history"].items()}  # type: ignore[union-attr]
        self.baseline = {k: tuple(v) for k, v in state["baseline"].items()}  # type: ignore[union-attr,misc]
        self.smoothed = dict(state["smoothed"])  # type: ignore[arg-type]
        self.level = dict(state.get("level", {}))  # type: ignore[arg-type]
        self.steps = int(state["steps"])  # type: ignore[arg-type]
        self.learned = int(state.get("learned", self.steps))  # type: ignore[arg-type]
        self.over = int(state["over"])  # type: ignore[arg-type]
