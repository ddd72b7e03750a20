"""The drift detectors ``lab.detector_eval`` compares, and how each is replayed on a ``Run``:
the shipped defaults, verl's ESS threshold, VCPO's rule, and the selective ``DriftDetector``
grid (with ``Traces``, the shortcut that scores a grid point without replaying it).

Imported by ``lab.detector_eval`` (run that: ``python -m lab.detector_eval --markdown``);
the candidates are described in its docstring. Runs in, first-alarm steps out.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import replace

from lab.detector_runs import Run
from modules.callbacks.drift_score import DriftDetector, Signal

# DriftDetector's defaults before issue 38 (kept here so the comparison survives a change of them)
SHIPPED = dict(
    signals=(
        Signal("train/kl_behavior", 1, log=True, min_scale=0.25, floor=1e-6, ceiling=0.2),
        Signal("train/clip_frac", 1, log=False, min_scale=0.02, ceiling=0.2),
        Signal("train/grad_norm", 1, log=True, min_scale=0.25),
        Signal("is/ess_frac", -1, log=False, min_scale=0.02, ceiling=0.1),
        Signal("mismatch/k3", 1, log=True, min_scale=0.25, floor=1e-6),
    ),
    warmup=10,
    threshold=4.0,
    patience=2,
    alpha=0.3,
)

# The selective grid: signal variants (``*_coarse``: a 2.7x change per unit of z), absolute
# safety nets, and the score's knobs.
VARIANTS = {
    "ess": Signal("is/ess_frac", -1, min_scale=0.02),
    "weight_max": Signal("is/weight_max", 1, log=True, min_scale=0.25),
    "entropy": Signal("train/entropy", 1, log=True, min_scale=0.1),
    "entropy_coarse": Signal("train/entropy", 1, log=True, min_scale=0.2),
    "kl": Signal("train/kl_behavior", 1, log=True, min_scale=0.25, floor=1e-6),
    "kl_coarse": Signal("train/kl_behavior", 1, log=True, min_scale=1.0, floor=1e-6),
    "grad_norm": Signal("train/grad_norm", 1, log=True, min_scale=0.25),
    "grad_norm_coarse": Signal("train/grad_norm", 1, log=True, min_scale=1.0),
}
NETS = {  # ceilings (floors for the ESS), scored from the first step
    "none": {},
    "shipped": {"train/kl_behavior": 0.2, "train/clip_frac": 0.2, "is/ess_frac": 0.1},
    "loose": {"train/kl_behavior": 1.0, "train/clip_frac": 0.2, "is/ess_frac": 0.05},
}
# ``baseline``: ``ramp`` learns the baseline once the delayed sync's lag reached K (what the drift
# monitor does); ``first`` learns it from the first trained step. With several optimizer steps per
# rollout batch the ramp lasts K batches (4K steps with 4 minibatches), so a ``ramp`` baseline is
# complete only at step 4K + warmup, after many collapses have begun.
GRID = dict(
    threshold=(2.0, 2.5, 3.0, 4.0),
    patience=(1, 2, 3),
    alpha=(0.3, 0.15),
    warmup=(10,),
    baseline=("ramp", "first"),
)
VCPO_GRID = dict(
    ess_drop=(0.5, 0.7, 0.9), spike=(3.0, 5.0, 10.0), window=(1, 5, 10), baseline=("ramp", "first")
)


class EssThreshold:
    """verl's rule: alarm at a step whose ESS fraction is below ``level`` (0.3: warn)."""

    def __init__(self, level: float) -> None:
        self.level = level

    def update(self, m: dict[str, float], learn: bool = True) -> bool:
        return "is/ess_frac" in m and not m["is/ess_frac"] >= self.level


class VcpoRule:
    """VCPO's diagnosis as an alarm: within the last ``window`` steps, the ESS fraction fell below
    ``ess_drop`` x its warm-up median and the gradient norm rose above ``spike`` x the median of
    the ``warmup`` steps before it."""

    def __init__(self, ess_drop: float, spike: float, window: int, warmup: int = 10) -> None:
        self.ess_drop, self.spike, self.window, self.warmup = ess_drop, spike, window, warmup
        self.ess: list[float] = []
        self.norms: list[float] = []
        self.last_drop = self.last_spike = -math.inf
        self.t = 0

    def update(self, m: dict[str, float], learn: bool = True) -> bool:
        self.t += 1
        if not learn:
            return False
        ess, norm = m.get("is/ess_frac"), m.get("train/grad_norm")
        if ess is not None:
            if len(self.ess) >= self.warmup and ess < self.ess_drop * statistics.median(
                self.ess[: self.warmup]
            ):
                self.last_drop = self.t
            self.ess.append(ess)
        if norm is not None:
            ref = self.norms[-self.warmup :]
            if len(ref) >= self.warmup and not norm <= self.spike * statistics.median(ref):
                self.last_spike = self.t
            self.norms.append(norm)
        return self.t - self.last_drop < self.window and self.t - self.last_spike < self.window


def first_alarm(detector, run: Run, from_first: bool = False) -> int | None:
    """The first step ``detector`` alarms on; ``from_first``: it learns from the first trained
    step on, not from the end of the lag's ramp."""
    for step, m, learn in run.steps:
        reading = detector.update(m, learn=learn or from_first)
        if getattr(reading, "alarm", reading):
            return step
    return None


def detector_of(config: dict) -> DriftDetector:
    """The ``DriftDetector`` a grid point stands for: its signals with the net's ceilings, and
    the net's other keys as ceiling-only signals."""
    net = NETS[config["net"]]
    signals = [replace(VARIANTS[v], ceiling=net.get(VARIANTS[v].key)) for v in config["signals"]]
    covered = {s.key for s in signals}
    signals += [
        Signal(key, -1 if key == "is/ess_frac" else 1, relative=False, ceiling=c)
        for key, c in net.items()
        if key not in covered
    ]
    knobs = {k: config[k] for k in ("threshold", "patience", "alpha", "warmup")}
    return DriftDetector(signals=signals, **knobs)


class Traces:
    """Each run's smoothed z per signal variant and smoothed raw level per net key, computed once
    per (alpha, warmup, baseline) with single-signal ``DriftDetector``s, so that a grid point is scored
    without replaying it (``DriftDetector.update``'s rule: alarm after ``patience`` steps with
    some z > threshold or some level past its ceiling; non-finite values count as past it)."""

    def __init__(self, runs: list[Run]) -> None:
        self.runs = runs
        self.cache: dict[tuple[float, int, str], list[dict[str, list[float]]]] = {}

    def of(self, alpha: float, warmup: int, baseline: str = "ramp") -> list[dict[str, list[float]]]:
        key = (alpha, warmup, baseline)
        if key not in self.cache:
            self.cache[key] = [self._trace(run, alpha, warmup, baseline == "first") for run in self.runs]
        return self.cache[key]

    @staticmethod
    def _trace(run: Run, alpha: float, warmup: int, from_first: bool) -> dict[str, list[float]]:
        dets = {v: DriftDetector(signals=[s], alpha=alpha, warmup=warmup) for v, s in VARIANTS.items()}
        keys = {k for net in NETS.values() for k in net}
        out: dict[str, list[float]] = {name: [] for name in [*dets, *keys]}
        level: dict[str, float] = {}
        for _, m, learn in run.steps:
            for v, det in dets.items():
                r = det.update(m, learn=learn or from_first)
                x = m.get(VARIANTS[v].key, 0.0)
                out[v].append(math.inf if not math.isfinite(x) else r.z.get(VARIANTS[v].key, -math.inf))
            for key in keys:
                x = m.get(key)
                if x is not None and math.isfinite(x):
                    level[key] = x if key not in level else (1 - alpha) * level[key] + alpha * x
                out[key].append(
                    math.nan if x is None else (level.get(key, 0.0) if math.isfinite(x) else math.inf)
                )
        return out

    def alarms(self, config: dict) -> list[int | None]:
        net, t, p = NETS[config["net"]], config["threshold"], config["patience"]
        result = []
        for run, tr in zip(
            self.runs, self.of(config["alpha"], config["warmup"], config.get("baseline", "ramp"))
        ):
            over, alarm = 0, None
            for i, (step, _, _) in enumerate(run.steps):
                hit = any(tr[v][i] > t for v in config["signals"])
                for key, c in net.items():
                    x = tr[key][i]
                    hit = hit or x == math.inf or (x > c if key != "is/ess_frac" else x < c)
                over = over + 1 if hit else 0
                if over >= p:
                    alarm = step
                    break
            result.append(alarm)
        return result


def grid_configs() -> list[dict]:
    families = [
        [v for v in combo if v]
        for combo in itertools.product(
            ("ess", None),
            ("weight_max", None),
            ("entropy", "entropy_coarse", None),
            ("kl", "kl_coarse", None),
            ("grad_norm", "grad_norm_coarse", None),
        )
    ]
    knobs = list(itertools.product(*GRID.values()))
    return [
        {"signals": fam, "net": net, **dict(zip(GRID, k))}
        for fam in families
        for net in NETS
        for k in knobs
        if fam or net != "none"
    ]


def replayed(make, runs: list[Run], from_first: bool = False) -> list[int | None]:
    return [first_alarm(make(), run, from_first) for run in runs]


def vcpo_alarms(config: dict, runs: list[Run]) -> list[int | None]:
    rule = {k: v for k, v in config.items() if k != "baseline"}
    return replayed(lambda: VcpoRule(**rule), runs, from_first(config))


def selective_alarms(config: dict, runs: list[Run]) -> list[int | None]:
    return replayed(lambda: detector_of(config), runs, from_first(config))


def from_first(config: dict) -> bool:
    """Whether a grid point learns its baseline from the first trained step (``baseline first``)."""
    return config.get("baseline") == "first"
