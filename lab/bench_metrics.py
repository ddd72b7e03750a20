"""Pure functions behind the rollout-mode benchmark's time-to-reward figures (no vLLM, no torch).

Used by ``lab/modes.py``; tested without an engine by

    python -m pytest -q tests/tools/test_bench_metrics.py

A held-out reward curve is a list of evaluation points ``(training wall-clock s, reward)`` in
increasing time. ``time_to_reward`` finds when a curve first reaches a target reward,
``target_from_finals`` turns the reference runs' final rewards into that target, and
``summarize_times`` aggregates per-seed results honestly (seeds that never reach the target are
counted, not averaged in). ``per_seed_ci`` / ``paired_per_seed_ci`` are the seed-as-unit
intervals every table of several runs per seed uses (average within seed first, then a t
interval over seeds).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Iterable, Mapping, Sequence


def _clean(times: Sequence[float], values: Sequence[float]) -> list[tuple[float, float]]:
    if len(times) != len(values):
        raise ValueError(f"times has {len(times)} entries but values has {len(values)}")
    pts = [(float(t), float(v)) for t, v in zip(times, values) if not math.isnan(float(v))]
    if any(b[0] < a[0] for a, b in zip(pts, pts[1:])):
        raise ValueError("evaluation times must be non-decreasing")
    return pts


def time_to_reward(
    times: Sequence[float], values: Sequence[float], target: float, interpolate: bool = True
) -> float | None:
    """First training wall time at which the curve reaches ``target``; None if it never does.

    With ``interpolate`` the curve is taken as linear between evaluation points, and the answer
    is where the segment from the last point below the target to the first point at or above
    it crosses the target. Without, it is the time of the first point at or above the target
    (an upper bound on the crossing, at the resolution of the evaluations). A curve that starts
    at or above the target reaches it at its first point. Points with NaN rewards are skipped.
    """
    pts = _clean(times, values)
    for i, (t, v) in enumerate(pts):
        if v >= target:
            if i == 0 or not interpolate:
                return t
            t0, v0 = pts[i - 1]
            return t0 + (target - v0) / (v - v0) * (t - t0)  # v0 < target <= v, so v > v0
    return None


def target_from_finals(finals: Sequence[float]) -> float:
    """The target reward: the mean of the reference runs' final held-out rewards (NaN skipped)."""
    vals = [float(v) for v in finals if not math.isnan(float(v))]
    if not vals:
        raise ValueError("no finite final reward to define a target from")
    return statistics.fmean(vals)


def summarize_times(per_seed: Sequence[float | None]) -> dict[str, object]:
    """Mean and population std over the seeds that reached the target; how many did.

    ``mean``/``std`` are None when no seed reached it. Seeds that did not reach it are not
    averaged in (they would need a time they never produced): read ``n_reached`` of ``n``.
    """
    reached = [float(t) for t in per_seed if t is not None]
    return {
        "mean": statistics.fmean(reached) if reached else None,
        "std": statistics.pstdev(reached) if len(reached) > 1 else (0.0 if reached else None),
        "n_reached": len(reached),
        "n": len(per_seed),
        "per_seed": [None if t is None else float(t) for t in per_seed],
    }


def interp(times: Sequence[float], values: Sequence[float], t: float) -> float:
    """Linear interpolation of the curve at ``t`` (clamped to its first and last points)."""
    pts = _clean(times, values)
    if not pts:
        return math.nan
    if t <= pts[0][0]:
        return pts[0][1]
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return pts[-1][1]


def mean_curve(
    curves: Sequence[tuple[Sequence[float], Sequence[float]]], points: int = 50
) -> tuple[list[float], list[float]]:
    """Mean over seeds of linearly interpolated curves, on a grid from 0 to the shortest run's
    last evaluation (so every seed contributes to every grid point)."""
    curves = [c for c in curves if len(c[0])]
    if not curves:
        return [], []
    end = min(max(ts) for ts, _ in curves)
    grid = [end * i / (points - 1) for i in range(points)] if points > 1 else [end]
    means = [statistics.fmean(interp(ts, vs, g) for ts, vs in curves) for g in grid]
    return grid, means


def mean_curve_held(
    curves: Sequence[tuple[Sequence[float], Sequence[float]]],
) -> tuple[list[float], list[float]]:
    """Mean over seeds of the reward of the policy each run has at time t, on the union of
    the runs' evaluation times. A run that has ended keeps its final reward (its policy still
    exists), so the mean ends exactly at the mean of the final rewards: the curve whose
    crossing of ``target_from_finals`` is the mode's time-to-reward with one number per mode."""
    curves = [(list(ts), list(vs)) for ts, vs in curves if len(ts)]
    if not curves:
        return [], []
    grid = sorted({float(t) for ts, _ in curves for t in ts})

    def at(ts: list[float], vs: list[float], t: float) -> float:
        return float(vs[-1]) if t >= ts[-1] else interp(ts, vs, t)

    return grid, [statistics.fmean(at(ts, vs, t) for ts, vs in curves) for t in grid]


# Two-sided 95 % Student t quantiles by degrees of freedom (no scipy here); beyond 30, normal.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)  # fmt: skip


def t95(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df={df}: a t interval needs at least 2 values")
    return _T95[df - 1] if df <= len(_T95) else 1.960


def finite(v: float | None) -> bool:
    """A value a table averages: not None, NaN or +-inf."""
    return v is not None and math.isfinite(float(v))


def mean_ci(values: Sequence[float | None]) -> dict[str, object]:
    """Mean over seeds with a 95 % t interval (sample std, ``n - 1``); None, NaN and +-inf
    skipped and counted. ``lo``/``hi`` are None with fewer than 2 values."""
    vals = [float(v) for v in values if finite(v)]
    out: dict[str, object] = {"mean": None, "lo": None, "hi": None, "std": None, "n": len(vals)}
    out["n_total"] = len(values)
    if not vals:
        return out
    m = statistics.fmean(vals)
    out["mean"] = m
    if len(vals) > 1:
        s = statistics.stdev(vals)
        half = t95(len(vals) - 1) * s / math.sqrt(len(vals))
        out.update(std=s, lo=m - half, hi=m + half)
    return out


def by_seed(pairs: Iterable[tuple[Hashable, float | None]]) -> dict[Hashable, list[float | None]]:
    """``(seed, value)`` pairs grouped by seed, seeds in first-seen order (the input of
    ``per_seed_ci``)."""
    out: dict[Hashable, list[float | None]] = {}
    for seed, value in pairs:
        out.setdefault(seed, []).append(value)
    return out


def seed_means(values: Mapping[Hashable, Sequence[float | None]]) -> dict[Hashable, float]:
    """Each seed's mean over its finite values (None, NaN and +-inf skipped); a seed with none
    is left out."""
    means = {}
    for seed, vs in values.items():
        kept = [float(v) for v in vs if finite(v)]
        if kept:
            means[seed] = statistics.fmean(kept)
    return means


def per_seed_ci(values: Mapping[Hashable, Sequence[float | None]]) -> dict[str, object]:
    """Mean and 95 % t interval with the seed as the unit: per-run values keyed by seed
    (``{seed: [value, ...]}``, e.g. the paired differences of several lags K of one seed, or
    runs of one seed from two builds) are averaged within each seed first, and ``mean_ci`` is
    taken over those seed means (``n`` = seeds with a finite value, df = n - 1). None, NaN and
    +-inf are skipped.

    Why not pool the runs: runs that share a seed share its prompts and first batches, so
    their outcomes move together; and when every lagged run of a seed is paired with the same
    K = 0 run, that one run's noise is in each difference. Pooling m such values per seed as
    independent divides the spread by about sqrt(m) more than the data warrant (9-15 (K, seed)
    pairs from 3 seeds read as n = 9-15). The seed means are independent across seeds, so this
    interval is valid where the pooled one is not. It is not conservative: it is usually wider
    than the pooled one, but it can be narrower, where a seed's values scatter more than the
    seeds' means do (averaging within seed removes that scatter).

    Returns ``mean_ci``'s keys (``std`` the sd of the seed means, ``n_total`` the seeds given)
    with ``n_runs`` (finite values averaged in) and ``seed_means`` ({seed: mean})."""
    means = seed_means(values)
    out = mean_ci(list(means.values()))
    out.update(
        n_total=len(values),
        n_runs=sum(finite(v) for vs in values.values() for v in vs),
        seed_means=means,
    )
    return out


def paired_per_seed_ci(
    a: Mapping[Hashable, Sequence[float | None]], b: Mapping[Hashable, Sequence[float | None]]
) -> dict[str, object]:
    """Arm ``a`` minus arm ``b`` matched by seed, averaged within seed first: each seed's mean
    over ``a``'s runs minus its mean over ``b``'s, over the seeds with a finite value in both,
    then ``per_seed_ci`` of those differences (n = matched seeds, df = n - 1; why: see
    ``per_seed_ci``). Where the pairs must match more finely than by seed (same lag, same build
    of the warm start), form those differences first and pass them to ``per_seed_ci`` keyed by
    seed.

    Counts: ``n`` the matched seeds, ``n_runs`` the finite runs of both arms in those seeds
    (what the differences average), ``n_total`` the seeds given in either arm, ``n_unmatched``
    the seeds with a finite value in only one arm (left out); ``seed_means`` holds each matched
    seed's difference."""
    ma, mb = seed_means(a), seed_means(b)
    both = [s for s in ma if s in mb]
    out = per_seed_ci({s: [ma[s] - mb[s]] for s in both})
    out.update(
        n_runs=sum(finite(v) for s in both for v in (*a[s], *b[s])),
        n_total=len(set(a) | set(b)),
        n_unmatched=len((set(ma) | set(mb)) - set(both)),
    )
    return out


def bootstrap_ci(
    a: Sequence[float], b: Sequence[float], op: str = "ratio", n_boot: int = 10000, seed: int = 0
) -> dict[str, float | None]:
    """``mean(a) / mean(b)`` (``op="ratio"``) or ``mean(a) - mean(b)`` (``op="diff"``) for two
    independent groups of seeds, with a 95 % percentile bootstrap interval (each group resampled
    with replacement on its own). None where a group is empty (or a ratio's denominator is 0)."""
    import random

    if op not in ("ratio", "diff"):
        raise ValueError(f"op={op!r}: ratio | diff")
    a = [float(v) for v in a]
    b = [float(v) for v in b]
    none = {"value": None, "lo": None, "hi": None}

    def stat(x: list[float], y: list[float]) -> float | None:
        mx, my = statistics.fmean(x), statistics.fmean(y)
        if op == "diff":
            return mx - my
        return mx / my if my != 0 else None

    if not a or not b or stat(a, b) is None:
        return none
    rng = random.Random(seed)
    draws = [stat(rng.choices(a, k=len(a)), rng.choices(b, k=len(b))) for _ in range(n_boot)]
    draws = sorted(d for d in draws if d is not None)
    return {
        "value": stat(a, b),
        "lo": draws[int(0.025 * (len(draws) - 1))],
        "hi": draws[int(0.975 * (len(draws) - 1))],
    }


def fall_from_peak(values: Sequence[float | None]) -> float:
    """How far a run's reward curve ends below its own best point: the highest evaluation
    minus the last (>= 0; 0 when the last is the best). A late fall (a run that peaks and then
    loses reward in its last steps) shows as a fall that exceeds the reference's, paired by
    seed; the final reward alone cannot tell a late fall from a slow rise. Non-finite points
    skipped; NaN without a finite last point."""
    vals = [float(v) for v in values if finite(v)]
    if not vals or not finite(values[-1]):
        return math.nan
    return max(vals) - vals[-1]


def reward_at(times: Sequence[float], values: Sequence[float], t: float) -> float:
    """The reward of the policy a run has at training time ``t``: linear between evaluations,
    the final reward after the run ends (its policy still exists)."""
    pts = _clean(times, values)
    if not pts:
        return math.nan
    return pts[-1][1] if t >= pts[-1][0] else interp([p[0] for p in pts], [p[1] for p in pts], t)


def _welch_df(terms: list[tuple[float, int]]) -> int:
    """Welch-Satterthwaite degrees of freedom of a sum of variance terms ``(v_i, n_i)`` (each
    ``v_i`` a variance of a mean from ``n_i`` values), rounded down (conservative)."""
    num = sum(v for v, _ in terms) ** 2
    den = sum(v * v / (n - 1) for v, n in terms if n > 1)
    return max(1, int(num / den)) if den > 0 else max(1, sum(n for _, n in terms) - len(terms))


def welch_diff_ci(a: Sequence[float], b: Sequence[float]) -> dict[str, float | None]:
    """``mean(a) - mean(b)`` for two independent groups of seeds with a 95 % Welch t interval
    (no equal-variance assumption); None with fewer than 2 values in a group."""
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) < 2 or len(b) < 2:
        return {"value": None, "lo": None, "hi": None, "df": None}
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    df = _welch_df([(va, len(a)), (vb, len(b))])
    half = t95(df) * math.sqrt(va + vb)
    return {"value": ma - mb, "lo": ma - mb - half, "hi": ma - mb + half, "df": df}


def ratio_ci(a: Sequence[float], b: Sequence[float]) -> dict[str, float | None]:
    """``mean(a) / mean(b)`` (positive values, e.g. times) with a 95 % interval from the delta
    method on its log: var(log R) ~ var(mean a)/mean(a)^2 + var(mean b)/mean(b)^2, Welch t
    quantile. None with fewer than 2 values in a group or a non-positive mean."""
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) < 2 or len(b) < 2 or statistics.fmean(a) <= 0 or statistics.fmean(b) <= 0:
        return {"value": None, "lo": None, "hi": None, "df": None}
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    va = statistics.variance(a) / len(a) / ma**2
    vb = statistics.variance(b) / len(b) / mb**2
    df = _welch_df([(va, len(a)), (vb, len(b))])
    half = t95(df) * math.sqrt(va + vb)
    r = ma / mb
    return {"value": r, "lo": r * math.exp(-half), "hi": r * math.exp(half), "df": df}
