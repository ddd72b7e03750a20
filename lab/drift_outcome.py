"""One drift-grid run's outcome from its logged metrics: collapse or not (and when), the drift
detector's first alarm replayed offline, the estimator's diagnostics.

Imported by ``lab.drift_grid`` (run that: ``python -m lab.drift_grid --analyze ...``) and
``lab.detector_eval``; the definitions (collapse, lead time, false alarm) are in
``lab.drift_grid``'s docstring. Reads metrics rows (``metrics.csv`` as dicts) and held-out
curves; no files.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from modules.callbacks.drift_score import DriftDetector


def collapse_step(rows: list[dict[str, str]], drop: float) -> int | None:
    """First step whose training-reward EMA is ``drop`` below its running maximum."""
    best = -math.inf
    for r in rows:
        if not r.get("train/reward_ema"):
            continue
        x = float(r["train/reward_ema"])
        best = max(best, x)
        if x <= best - drop:
            return int(r["step"])
    return None


SLIDE_WARMUP = 10  # trained steps whose mean training reward is a slide's reference


def stays_below_from(points: Iterable[tuple[int, float]], level: float) -> int | None:
    """The first step of the final stretch of ``(step, value)`` points below ``level`` (a NaN
    value counts as below); None if the last point is not below it."""
    since = None
    for step, x in points:
        since = (since if since is not None else step) if not x >= level else None
    return since


def below_start_step(rows: list[dict[str, str]], warmup: int = SLIDE_WARMUP) -> int | None:
    """First step from which the training-reward EMA stays below the mean training reward of
    the first ``warmup`` trained steps until the end of the run (the training-side twin of
    "held-out reward below the warm start"); dates a slide that never drops ``--drop`` below
    its peak."""
    raw = [(int(r["step"]), float(r["train/reward_mean"])) for r in rows if r.get("train/reward_mean")]
    raw = raw[:warmup]
    if len(raw) < warmup:
        return None
    start, warm_end = statistics.fmean(x for _, x in raw), raw[-1][0]
    # only after the reference window: a date inside it could precede any alarm
    ema = ((int(r["step"]), float(r["train/reward_ema"])) for r in rows if r.get("train/reward_ema"))
    return stays_below_from(((step, x) for step, x in ema if step > warm_end), start)


def replay(rows: list[dict[str, str]], lag: int = 0, **detector: float) -> int | None:
    """First alarm step of a fresh detector fed the run's logged metrics step by step, as the
    monitor feeds it with its default ``callbacks.drift.baseline=ramp``: trained steps only, the
    baseline from the step the delayed sync's lag reached K (the ceilings from the first step).
    A run launched with ``baseline=first`` is replayed as such by ``lab.detector_eval``, not here."""
    det = DriftDetector(**detector)
    by_step: dict[int, dict[str, float]] = {}
    for r in rows:
        if r.get("step"):
            values = {k: float(v) for k, v in r.items() if v not in ("", None)}
            by_step.setdefault(int(r["step"]), {}).update(values)
    ramped = lag == 0
    for step in sorted(by_step):
        m = by_step[step]
        if "train/loss" not in m:
            continue  # not a trained step (an evaluation row)
        ramped = ramped or m.get("rollout/staleness_max", 0.0) >= lag  # the configured K
        if det.update(m, learn=ramped).alarm:
            return step
    return None


# How far below the warm start a held-out point must be to date a fall: at lr 2e-3 the first
# evaluation (step 4, before any lag acts) sits 0.01-0.04 below it (seeds 2 / 0 / 1) and most
# runs recover, so "below the start" alone would date a run that later falls at that first dip.
# About 4.5 standard errors of the difference of two evaluations (each ~0.008).
HELDOUT_MARGIN = 0.05


def dense(curve: list[dict]) -> bool:
    """A held-out curve evaluated somewhere between the run's start and its end."""
    return len([p for p in curve if p.get("step")]) >= 2


def heldout_step(curve: list[dict], level: float) -> int | None:
    """The training step that produced the first evaluated weights from which the held-out
    sampled reward stays below ``level`` until the run's last evaluation (None: it ends at or
    above it, or the curve is not ``dense``). A checkpoint of step N holds the weights after N
    optimizer steps, made by the update of metrics row N - 1: that row is the date, in the unit
    of the detector's alarm steps (an alarm on the very update that made them leads by 0). The
    fall happened after the evaluation before: the date is late by less than the evaluation
    interval. A point without a sampled reward counts as below."""
    if not dense(curve):
        return None
    points = [
        (int(p["step"]) - 1, p.get("eval/sampled_reward_mean", math.nan)) for p in curve if p.get("step")
    ]
    return stays_below_from(points, level)


def outcome(
    rows: list[dict[str, str]],
    last: dict | None,
    curve: list[dict] | None,
    start: float,
    drop: float,
    detector: dict,
    lag: int = 0,
) -> dict:
    """One run's outcome from its metrics rows, final held-out evaluation and held-out curve. A
    run with no final evaluation (``last`` None) stopped early (non-finite losses): a collapse
    dated at its last logged step. A collapse with a held-out curve evaluated between its ends
    is dated on it (``heldout_step`` at ``HELDOUT_MARGIN`` below the start), independently of
    the training reward, or not at all."""
    stopped = last is None
    last = last or {}
    final = last.get("eval/sampled_reward_mean", float("nan"))
    collapsed = not final >= start
    curve = curve or []
    c_step, rule = None, None
    if collapsed and dense(curve):
        c_step = heldout_step(curve, start - HELDOUT_MARGIN)
        rule = "heldout" if c_step is not None else None
    elif collapsed:
        c_step, rule = collapse_step(rows, drop), "drop"
        if c_step is None and stopped:
            c_step, rule = max((int(r["step"]) for r in rows if r.get("step")), default=0), "stopped"
        if c_step is None:
            c_step, rule = below_start_step(rows), "below_start"
        if c_step is None:
            rule = None
    alarm = replay(rows, lag, **detector)
    acted = any(float(r.get("controller/notches") or 0) > 0 for r in rows)
    return {
        "final_sampled": final,
        "collapsed": collapsed,
        "collapse_step": c_step,
        "collapse_rule": rule,
        "first_alarm": alarm,
        "lead_steps": (c_step - alarm) if (c_step is not None and alarm is not None) else None,
        # a run the controller acted on did not collapse *because* of the alarm: not a false one
        "acted": acted,
        "false_alarm": None if acted else (not collapsed) and alarm is not None,
        "greedy": last.get("eval/reward_mean", float("nan")),
        "diagnostics": diagnostics(rows, lag),
    }


DIAGNOSTICS = (
    "is/ess_frac",
    "is/zeroed_frac",
    "train/kl_behavior",
    "train/clip_frac",
    "train/grad_norm",
    "ratio/mu_out_frac",  # the share of tokens outside 1 -+ 0.2 against each anchor
    "ratio/pi_old_out_frac",
)
# the largest value in the run; the logprob gap between engine and trainer (at K = 0, mu vs
# pi_old) tells whether a K = 0 cell stands for every decoupled arm (``engine_matches_trainer``)
PEAKS = ("is/weight_max", "ratio/mu_max", "ratio/pi_old_max", "mismatch/max_abs_logp_diff")


def diagnostics(rows: list[dict[str, str]], lag: int = 0) -> dict[str, float]:
    """Medians of the estimator's diagnostics over the trained steps at the full lag (the
    delayed sync's ramp, staleness < K, excluded), and the largest importance weight seen."""
    steady = [
        r
        for r in rows
        if r.get("step") and r.get("train/loss") and float(r.get("rollout/staleness_max") or 0.0) >= lag
    ]
    out = {}
    for keys, reduce in ((DIAGNOSTICS, statistics.median), (PEAKS, max)):
        for key in keys:
            values = [float(r[key]) for r in steady if r.get(key)]
            if values:  # a metric the run did not log (older runs: ratio/*) is left out
                out[key] = reduce(values)
    return out
