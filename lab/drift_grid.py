"""Estimator drift on the real engine: lag K x correction, the bf16 mismatch, detector lead time.

    python -m lab.drift_grid                                     # K x correction grid, 3 seeds
    python -m lab.drift_grid --lags 0 4 --corrections none tis --seeds 0 -- trainer.max_steps=30
    python -m lab.drift_grid --mismatch                          # bf16 engine, float32 trainer
    python -m lab.drift_grid --controller                        # + callbacks/drift=controller
    python -m lab.drift_grid --analyze outputs/bench/drift       # re-read finished runs
    python -m lab.drift_grid --resume --out outputs/bench/drift  # finish an interrupted grid
    python -m lab.drift_grid --resume --store lab/results/drift_grid_3e-3.jsonl ...  # across sessions
    python -m lab.drift_grid --replay outputs/bench/modes5/*/seed*   # the detector on any runs

Each cell is ``sync_grpo`` with a delayed weight sync (``callbacks.weight_sync.lag=K``: every
trained token exactly K versions old) and a correction: ``none`` keeps the bypass anchor (pi_old
:= mu, the PPO ratio against the behaviour policy, as the shipped recipes do); every other
correction runs with the decoupled anchor, so it sees pi_old / mu. Every run carries the drift
monitor (``callbacks/drift=monitor``: no actions), so the detector's alarms and its inputs are
in each run's metrics.csv; ``--analyze`` replays ``modules.callbacks.drift_score.DriftDetector`` offline on
them (other thresholds can be tried without training again).

Definitions (per run):
* collapse: the held-out sampled reward of the final policy is below the warm start's, or the
  run stopped on non-finite losses; the collapse *step* is, where the held-out curve was
  evaluated between the run's ends (``--eval-every`` a few versions), the first evaluated step
  from which that reward stays more than ``HELDOUT_MARGIN`` (0.05) below the warm start's
  (``heldout``; dated at the training step whose update made those weights; a run ending
  closer to the start has no date there); otherwise the first step at
  which the training reward's EMA (``train/reward_ema``) falls ``--drop`` below its running
  maximum, or, for a slow slide that never drops that far, the first step from which the EMA
  stays below the mean training reward of the first 10 steps (``collapse_rule`` says which
  dated it: ``heldout``, then ``drop``, then ``stopped`` for a run that ended on non-finite
  losses, then ``below_start``);
* lead time: collapse step minus the first alarm step (positive: the alarm came first);
* false alarm: an alarm in a run that did not collapse and that no controller acted on (a
  controlled run that did not collapse after acting on an alarm is counted as ``acted``).

Runs are ``lab.modes`` runs (same post-hoc held-out curve); writes ``result.json`` with
the K x correction table (final reward mean and spread over seeds, collapse yes/no and step)
and the detector's lead times and false alarms.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import shutil
import statistics
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

from lab import bench_metrics, run_store
from lab.modes import read_metrics, run_dir_name, run_recipe
from modules.callbacks.drift_score import DriftDetector

ROOT = Path(__file__).resolve().parents[1]
# The grid's arms: the anchor, the trust region and the correction are separate factors, so
# that two arms differ in what their names say. ``bypass``: PPO clip of pi / mu (the shipped
# recipes); ``bypass_noclip``: the same surrogate without the clip (``algo/objective=reinforce``:
# sg(pi / mu) A grad log pi, no trust region; the gradient of decoupled + untruncated token_is
# without a clip); ``decoupled``: PPO clip of pi / pi_old and no behaviour weight; every other
# arm is that plus the named correction of pi_old / mu. ``none`` is the old name of ``bypass``.
ARMS = ["bypass", "bypass_noclip", "decoupled", "tis", "tseq_is", "token_is", "icepop"]
CORRECTIONS = ["none", "token_is", "tis", "tseq_is", "geo_seq_is", "icepop", "ds_seq_mask"]
MISMATCH = ["none", "tis", "mis", "icepop"]


def arm_overrides(arm: str) -> list[str]:
    """The overrides of one arm (see ``ARMS``), in the order the stored cell specs use."""
    if arm in ("none", "bypass"):
        return ["algo/correction=none"]
    if arm == "bypass_noclip":
        return ["algo/correction=none", "algo/objective=reinforce"]
    correction = "none" if arm == "decoupled" else arm
    return [f"algo/correction={correction}", "algo.loss.anchor=decoupled"]


def arm_of(spec: str) -> str:
    """The arm a cell spec runs (``cell_spec``'s inverse)."""
    parts = spec_overrides(spec)
    correction = parts.get("algo/correction", "none")
    if parts.get("algo.loss.anchor") == "decoupled":
        return "decoupled" if correction == "none" else correction
    if correction == "none":
        return "bypass_noclip" if parts.get("algo/objective") == "reinforce" else "bypass"
    return correction


def cell_spec(lag: int, arm: str, extra: list[str] | None = None, controller: bool = False) -> str:
    drift = "controller" if controller else "monitor"
    first, *rest = arm_overrides(arm)
    parts = [f"callbacks.weight_sync.lag={lag}", first, f"callbacks/drift={drift}", *rest]
    return "sync_grpo:" + ",".join([*parts, *(extra or [])])


def mean_ci(xs: list[float]) -> dict:
    """``bench_metrics.mean_ci`` as the tables read it: mean, 95 % t interval (None with fewer
    than 2 values), n and ``inside_noise`` (the interval holds 0)."""
    ci = bench_metrics.mean_ci(xs)
    lo, hi = ci["lo"], ci["hi"]
    interval = None if lo is None else [lo, hi]
    return {
        "mean": math.nan if ci["mean"] is None else ci["mean"],
        "ci": interval,
        "n": ci["n"],
        "inside_noise": None if interval is None else lo <= 0 <= hi,
    }


# Corrections whose weight is 1 wherever pi_old / mu = 1: at K = 0 (mu is pi_old) they compute
# plain decoupled's loss. Not ds_seq_mask (it compares mu with the current pi, which moves
# after the first minibatch), m2po (a quantile mask) or lag (a weight by version).
IDENTITY_AT_K0 = ("token_is", "tis", "seq_is", "tseq_is", "geo_seq_is", "mis", "icepop", "vtrace")
MAX_K0_LOGP_DIFF = 1e-3  # nats: engine and trainer agree (float32 engines: ~1e-5; bf16: 1-10)


def engine_matches_trainer(run: dict) -> bool:
    """The run logged its engine-vs-trainer logprob gap and it stayed within
    ``MAX_K0_LOGP_DIFF``: there, a weight pi_old / mu at K = 0 is 1 up to float error."""
    gap = run.get("diagnostics", {}).get("mismatch/max_abs_logp_diff", math.nan)
    return math.isfinite(gap) and gap <= MAX_K0_LOGP_DIFF


def run_key(run: dict) -> tuple[int, int]:
    """What pairs two runs: the seed, within one build of the warm start."""
    return run["seed"], run.get("build", 0)


def paired(cells: dict[str, dict], reference: str, key: str = "final_sampled") -> dict[str, dict]:
    """Each cell's ``key`` (final held-out sampled or greedy reward) minus its reference cell's,
    paired by seed within a build of the warm start (a run's ``build``: 0 for the store being
    written, i for the i-th ``--with-store``; never across builds), with a 95 % t interval
    (``mean_ci``). ``reference``: ``k0`` pairs a lagged cell with the same arm (and the same
    other overrides) at K = 0. A run of a corrected decoupled arm whose build has no K = 0 run
    of that arm pairs with plain ``decoupled``'s K = 0 run instead, where that is the same loss:
    a correction in ``IDENTITY_AT_K0`` (weight 1 where mu is pi_old) and an engine that agreed
    with the trainer in that run (``engine_matches_trainer``: not a bf16 engine); the result's
    ``reference`` names it and ``reference_n`` counts those pairs. An arm's name (``bypass``,
    ``decoupled``, ...) pairs a cell with that arm at the same K (and the same other
    overrides). Cells without a reference are left out."""
    ref_key, ref_spec, fallback = {}, {}, {}
    for spec in cells:
        parts = spec_overrides(spec)
        if reference == "k0":
            parts.pop("callbacks.weight_sync.lag", None)
            is_ref = lag_of(spec) == 0
            if (
                parts.get("algo.loss.anchor") == "decoupled"
                and parts.get("algo/correction") in IDENTITY_AT_K0
            ):
                fallback[spec] = tuple(sorted({**parts, "algo/correction": "none"}.items()))
        elif reference in ARMS:
            for k in ("algo/correction", "algo.loss.anchor", "algo/objective"):
                parts.pop(k, None)
            is_ref = arm_of(spec) == reference
        else:
            raise ValueError(f"reference must be 'k0' or one of {ARMS}, got {reference!r}")
        ref_key[spec] = tuple(sorted(parts.items()))
        if is_ref:
            ref_spec[ref_key[spec]] = spec
    out = {}
    for spec, cell in cells.items():
        own = ref_spec.get(ref_key[spec])
        if own == spec:
            continue
        refs = {run_key(r): r for r in cells[own]["runs"]} if own else {}
        alt = ref_spec.get(fallback[spec]) if spec in fallback else None
        alts = {run_key(r): r for r in cells[alt]["runs"] if engine_matches_trainer(r)} if alt else {}
        diffs, via_alt = [], 0
        for r in cell["runs"]:
            at = run_key(r)
            partner = refs.get(at) or alts.get(at)
            x, y = r.get(key, math.nan), (partner or {}).get(key, math.nan)
            if math.isfinite(x) and math.isfinite(y):
                diffs.append(x - y)
                via_alt += at not in refs
        if diffs:
            out[spec] = mean_ci(diffs)
            if via_alt:
                out[spec].update(reference="decoupled", reference_n=via_alt)
    return out


def add_paired_differences(cells: dict[str, dict]) -> None:
    """Each cell's paired differences (by seed): ``vs_k0`` / ``greedy_vs_k0`` (sampled / greedy
    minus the same arm at K = 0), ``vs_bypass`` / ``greedy_vs_bypass`` (minus ``bypass`` at the
    same K: anchor, clip and correction together) and ``vs_decoupled`` / ``greedy_vs_decoupled``
    (minus plain ``decoupled`` at the same K: the correction alone, for the corrected arms)."""
    for reference in ("k0", "bypass", "decoupled"):
        for prefix, key in (("", "final_sampled"), ("greedy_", "greedy")):
            for spec, diff in paired(cells, reference, key).items():
                if reference != "decoupled" or arm_of(spec) not in ("bypass", "bypass_noclip"):
                    cells[spec][f"{prefix}vs_{reference}"] = diff


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


def spec_overrides(spec: str) -> dict[str, str]:
    """A cell spec's overrides, key -> value, in order ('sync_grpo:a=1,b=2' -> {a: 1, b: 2})."""
    return dict(part.partition("=")[::2] for part in spec.partition(":")[2].split(","))


def lag_of(spec: str) -> int:
    return int(spec_overrides(spec).get("callbacks.weight_sync.lag", 0))


def analyze_run(run_dir: Path, start: float, drop: float, detector: dict, lag: int = 0) -> dict:
    """One run directory's outcome (see ``outcome``)."""
    return outcome(*dir_run(run_dir), start, drop, detector, lag)


def dir_run(run_dir: Path) -> tuple[list[dict[str, str]], dict | None, list[dict]]:
    """A run directory's metrics rows, final held-out evaluation (None: there is none) and
    held-out curve (``run_store.curve_points``; empty: there is none)."""
    rows = read_metrics(run_dir) if (run_dir / "metrics.csv").exists() else []
    summary_path = run_dir / "eval_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return rows, summary.get("last"), run_store.curve_points(summary.get("history") or [])


def is_finished(run_dir: Path) -> bool:
    """A run wrote its last two files: the post-hoc held-out curve, then the summary read from it."""
    return all((run_dir / f).exists() for f in ("heldout_curve.json", "eval_summary.json"))


def find_run(
    out: Path, spec: str, seed: int, stored: dict | None
) -> tuple[list[dict[str, str]], dict | None, list[dict]] | None:
    """A run's (rows, last, curve): from the store first, else from its directory under ``out``.
    Without a store, a directory with no held-out curve is a run that stopped early (non-finite
    losses); with one (which holds such runs), it is unfinished (still going, crashed, killed):
    None, as for a run that is nowhere."""
    if stored and (spec, seed) in stored:
        rec = stored[(spec, seed)]
        return rec["rows"], rec["last"], rec.get("curve") or []
    run_dir = out / run_dir_name(spec) / f"seed{seed}"
    if (run_dir / "metrics.csv").exists() and (is_finished(run_dir) or stored is None):
        return dir_run(run_dir)
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


def start_reward(out: Path | None, stored: dict | None = None) -> float:
    """The warm start's held-out sampled reward: the initial evaluations cached under ``out``
    and the one each stored run began from, which must agree to 1e-6: a store holds one build of
    the warm start (rebuilt on another machine, it differs in its last bits and its runs do not
    pair with these: keep them in another store, read beside this one with ``--with-store``);
    NaN with none of them."""
    starts = [rec["start_sampled"] for rec in (stored or {}).values()]
    starts += [
        json.loads(p.read_text())["metrics"]["eval/sampled_reward_mean"]
        for p in ((out / "initial_eval").glob("*.json") if out is not None else ())  # None: the store's only
    ]
    distinct = {round(x, 6) for x in starts if x is not None and math.isfinite(x)}
    hashes = warm_start_hashes(stored or {})
    if len(distinct) > 1 or len(hashes) > 1:
        raise SystemExit(
            f"runs from different warm starts (held-out sampled {sorted(distinct)}, weights "
            f"{sorted(h[:12] for h in hashes)}): not comparable; a store holds one build (another "
            "build's runs: another store, read with --with-store)"
        )
    return next((x for x in starts if x is not None and math.isfinite(x)), math.nan)


def table(
    out: Path,
    specs: list[str],
    seeds: list[int],
    drop: float,
    detector: dict,
    stored: dict | None = None,
    others: list[dict] | tuple = (),
) -> dict:
    """The cells' outcomes from the ``stored`` records (``lab.run_store.load``) and the
    run directories under ``out`` (``find_run``); each cell lists the seeds it lacks. ``others``:
    the records of stores from other builds of the warm start (``--with-store``), read beside
    these: their runs join the cells as ``build`` 1, 2, ..., each judged against its own store's
    start and paired only within its build (``other_build`` counts them per cell)."""
    cells = {}
    start = start_reward(out, stored)
    other_starts = [start_reward(None, other) for other in others]
    seen = [start] if math.isfinite(start) else []
    for i, other_start in enumerate(other_starts, start=1):
        if not math.isfinite(other_start):
            raise SystemExit(f"--with-store #{i} holds no run with a warm-start evaluation")
        if any(abs(other_start - x) <= 1e-6 for x in seen):
            raise SystemExit(
                f"--with-store #{i} is a build already read (warm start {other_start:.6f}): its runs "
                "would count twice"
            )
        seen.append(other_start)
    for spec in specs:
        runs, missing = [], []
        for seed in seeds:
            found = find_run(out, spec, seed, stored)
            if found is None:
                missing.append(seed)
                continue
            if math.isnan(start):
                raise SystemExit(f"no warm-start evaluation under {out / 'initial_eval'} nor in the store")
            runs.append({"seed": seed, "build": 0, **outcome(*found, start, drop, detector, lag_of(spec))})
        for build, (other, other_start) in enumerate(zip(others, other_starts), start=1):
            for seed in seeds:
                if (spec, seed) in other:
                    rec = other[(spec, seed)]
                    o = outcome(
                        rec["rows"], rec["last"], rec.get("curve"), other_start, drop, detector, lag_of(spec)
                    )
                    runs.append({"seed": seed, "build": build, **o})
        if not runs:
            continue
        # a run that stopped early (non-finite losses) has no final evaluation: counted as a
        # collapse, left out of the mean
        finals = [r["final_sampled"] for r in runs if math.isfinite(r["final_sampled"])] or [math.nan]
        greedy = [r["greedy"] for r in runs if math.isfinite(r["greedy"])] or [math.nan]
        leads = [r["lead_steps"] for r in runs if r["lead_steps"] is not None]
        by_rule = [(r["collapse_rule"], r["lead_steps"]) for r in runs if r["lead_steps"] is not None]
        cells[spec] = {
            "final_sampled_mean": statistics.fmean(finals),
            "final_sampled_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "greedy_mean": statistics.fmean(greedy),
            "unevaluated": sum(not math.isfinite(r["final_sampled"]) for r in runs),
            "diagnostics": {
                key: statistics.fmean(r["diagnostics"][key] for r in runs if key in r["diagnostics"])
                for key in dict.fromkeys(k for r in runs for k in r["diagnostics"])
            },
            "collapsed": sum(r["collapsed"] for r in runs),
            "collapse_steps": [r["collapse_step"] for r in runs if r["collapsed"]],
            "lead_steps": leads,
            "lead_steps_by_rule": {rule: [x for q, x in by_rule if q == rule] for rule, _ in by_rule},
            "missed_collapses": sum(r["collapsed"] and r["first_alarm"] is None for r in runs),
            "false_alarms": sum(bool(r["false_alarm"]) for r in runs),
            "acted": sum(r["acted"] for r in runs),
            "n": len(runs),
            "other_build": sum(r["build"] > 0 for r in runs),
            "missing_seeds": missing,
            "runs": runs,
        }
    add_paired_differences(cells)
    # runs that did not collapse and that no controller steered: where an alarm is a false one
    healthy = sum(1 for c in cells.values() for r in c["runs"] if not r["collapsed"] and not r["acted"])
    return {
        "cells": cells,
        "detector": detector,
        "false_alarm_rate": sum(c["false_alarms"] for c in cells.values()) / healthy if healthy else None,
        "lead_steps_all": [x for c in cells.values() for x in c["lead_steps"]],
    }


def pending_seeds(out: Path, spec: str, seeds: list[int], stored: dict | None = None) -> list[int]:
    """The seeds of ``spec`` with no finished run under ``out`` (finished: its post-hoc held-out
    curve was written, the last thing a run does) nor in the ``stored`` records; a partial
    directory left by a killed run is removed, so that the rerun starts clean."""
    todo = []
    for seed in seeds:
        run_dir = out / run_dir_name(spec) / f"seed{seed}"
        if is_finished(run_dir) or (spec, seed) in (stored or {}):
            continue
        if run_dir.exists():
            shutil.rmtree(run_dir)
        todo.append(seed)
    return todo


@contextlib.contextmanager
def run_lock(out: Path, spec: str, seed: int) -> Iterator[bool]:
    """Hold ``seed<N>.lock`` beside the run's directory while it runs; yields False when
    another worker holds it (two workers on one run would write into one directory). The lock
    is the OS's (``flock``): a killed worker releases it."""
    path = out / run_dir_name(spec) / f"seed{seed}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def other_build(rec: dict, stored: dict) -> str | None:
    """Why ``rec`` began from another build of the warm start than the ``stored`` runs (its
    weight hash or its held-out start differs from theirs), or None."""
    starts = {round(r["start_sampled"], 6) for r in stored.values() if _finite(r.get("start_sampled"))}
    hashes = warm_start_hashes(stored)
    if rec.get("warm_start") and hashes and rec["warm_start"] not in hashes:
        return (
            f"its warm start's weights {rec['warm_start'][:12]} are not the store's {sorted(hashes)[0][:12]}"
        )
    if _finite(rec.get("start_sampled")) and starts and round(rec["start_sampled"], 6) not in starts:
        return (
            f"its warm start evaluates at {rec['start_sampled']:.6f}, the store's at {sorted(starts)[0]:.6f}"
        )
    return None


def warm_start_hashes(stored: dict) -> set[str]:
    """The warm-start weight hashes the ``stored`` runs recorded (older runs recorded none)."""
    return {rec.get("warm_start") for rec in stored.values()} - {None}


def _finite(x: object) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def archive(out: Path, spec: str, results: list[dict], store: Path, stored: dict, setup: dict) -> None:
    """Append ``spec``'s finished runs that the store lacks: those with a held-out evaluation, and
    those that stopped on non-finite losses (``run_recipe``'s ``diverged``: an outcome of the
    experiment); a run that failed otherwise (an engine crash, a kill) is not stored, so
    ``--resume`` runs it again."""
    for result in results:
        seed = result["seed"]
        run_dir = out / run_dir_name(spec) / f"seed{seed}"
        finished = is_finished(run_dir)
        if (spec, seed) in stored or not (finished or result.get("diverged")):
            continue
        rec = run_store.record(run_dir, spec, seed, setup, None if finished else result["error"])
        reason = other_build(rec, stored)
        if reason:
            raise SystemExit(
                f"{run_dir} is not stored in {store}: {reason}. This machine's warm start is another "
                "build than the store's: give it its own store (and its own K = 0 runs) and read "
                "this one beside it with --with-store"
            )
        run_store.append(store, rec)
        stored[(spec, seed)] = rec


def sweep(out: Path, specs: list[str], seeds: list[int], store: Path, stored: dict, setup: dict) -> None:
    """Store the finished runs under ``out`` that the store lacks (a worker killed between
    finishing a run and storing it), each under its run lock: a run another worker holds may be
    between its last two files, and is left to that worker to store."""
    for spec in specs:
        for seed in seeds:
            with run_lock(out, spec, seed) as mine:
                if mine:
                    archive(out, spec, [{"seed": seed}], store, stored, setup)


def check_setup(stored: dict, specs: list[str], setup: dict) -> None:
    """Refuse a store whose runs of these cells ran with other overrides or evaluation interval:
    ``--resume`` would skip them and the table would mix two experiments."""
    for (spec, seed), rec in stored.items():
        theirs = {k: rec.get(k) for k in ("overrides", "eval_every")}
        ours = {k: setup[k] for k in theirs}
        if spec in specs and theirs != ours:
            raise SystemExit(
                f"the store's {short(spec)} seed {seed} ran with {theirs}, this command has {ours}"
            )


def short(spec: str) -> str:
    """'K=8 tis decoupled +controller' for a cell spec."""
    out = []
    for key, value in spec_overrides(spec).items():
        if key == "callbacks.weight_sync.lag":
            out.append(f"K={value}")
        elif key == "algo/correction":
            out.append(arm_of(spec))
        elif key in ("algo.loss.anchor", "algo/objective"):
            continue  # in the arm's name
        elif key == "callbacks/drift":
            out.append("+controller" if value == "controller" else "")
        else:
            out.append(f"{key}={value}")
    return " ".join(o for o in out if o)


def reward_text(cell: dict) -> str:
    """One cell of the reward table: mean +- sd (n evaluated), greedy, stopped runs, collapses."""
    n = cell["n"] - cell["unevaluated"]
    text = f"{cell['final_sampled_mean']:.3f} +- {cell['final_sampled_std']:.3f} ({n})" if n else "-"
    if n and math.isfinite(cell.get("greedy_mean", math.nan)):
        text += f" / {cell['greedy_mean']:.3f}"
    if cell["unevaluated"]:
        text += f", {cell['unevaluated']} stopped"
    if cell["collapsed"]:
        steps = "/".join(str(x) for x in cell["collapse_steps"] if x is not None)
        text += f", **{cell['collapsed']} collapsed**" + (f" @{steps}" if steps else "")
    if cell.get("other_build"):
        text += f" ({cell['other_build']} of another build)"
    return text


def diagnostics_text(cell: dict) -> str:
    d = defaultdict(lambda: math.nan, cell["diagnostics"])
    return f"{d['is/ess_frac']:.2f} / {d['train/kl_behavior']:.3f} / {d['train/clip_frac']:.2f}"


def anchors_text(cell: dict) -> str:
    d = defaultdict(lambda: math.nan, cell["diagnostics"])
    return (
        f"{d['ratio/mu_out_frac']:.2f} / {d['ratio/pi_old_out_frac']:.2f} / {d['ratio/mu_max']:.1f} / "
        f"{d['is/weight_max']:.1f}"
    )


def ci_text(p: dict | None) -> str:
    """mean [95 % CI], in italics when the interval holds 0, bold when it does not."""
    if not p or p["ci"] is None:
        return ""
    text = f"{p['mean']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}]"
    text = f"*{text}*" if p["inside_noise"] else f"**{text}**"
    if not p.get("reference"):
        return text
    some = "" if p.get("reference_n", p["n"]) == p["n"] else f" for {p['reference_n']} of {p['n']}"
    return f"{text} (vs {p['reference']}{some})"


def paired_text(cell: dict) -> str:
    """The paired difference to K = 0 (sampled)."""
    return ci_text(cell.get("vs_k0"))


def greedy_paired_text(cell: dict) -> str:
    return ci_text(cell.get("greedy_vs_k0"))


def bypass_text(cell: dict) -> str:
    """The paired difference to ``bypass`` at the same K: sampled / greedy."""
    s, g = ci_text(cell.get("vs_bypass")), ci_text(cell.get("greedy_vs_bypass"))
    return f"{s} / {g}" if s else ""


def decoupled_text(cell: dict) -> str:
    """The paired difference to plain ``decoupled`` at the same K: sampled / greedy."""
    s, g = ci_text(cell.get("vs_decoupled")), ci_text(cell.get("greedy_vs_decoupled"))
    return f"{s} / {g}" if s else ""


def markdown(cells: dict[str, dict], start: float) -> str:
    """The lag x correction table of a ``table`` result as Markdown: final held-out sampled
    reward (mean +- sd over seeds, n), collapses (count and dated steps); then the estimator's
    diagnostics per cell (means over seeds of the per-run medians at full lag)."""
    grid: dict[tuple[str, str], dict] = {}
    for spec, cell in cells.items():
        parts = spec_overrides(spec)
        row = f"K = {parts.get('callbacks.weight_sync.lag', '0')}"
        row += " (bf16 engine)" if parts.get("engine.dtype") == "bfloat16" else ""
        row += " + controller" if parts.get("callbacks/drift") == "controller" else ""
        grid[(row, arm_of(spec))] = cell
    rows = list(dict.fromkeys(r for r, _ in grid))
    used = {c for _, c in grid}
    cols = [c for c in dict.fromkeys([*ARMS, *CORRECTIONS, *MISMATCH, *sorted(used)]) if c in used]
    titles = {
        reward_text: "Final held-out sampled reward, mean +- sd (n runs) / greedy mean; collapsed = final below the "
        f"warm start ({start:.3f})",
        diagnostics_text: "Diagnostics at full lag (medians per run, mean over seeds): ESS fraction / "
        "behaviour KL / clip fraction",
        paired_text: "Final held-out sampled reward minus K = 0's, same arm (or plain `decoupled`'s where marked), "
        "paired by seed within a build: mean [95 % t CI]; italics: inside the noise (the interval holds 0)",
        greedy_paired_text: "The same for the greedy held-out reward (minus K = 0's, same arm or where marked plain "
        "`decoupled`'s, paired by seed within a build)",
        bypass_text: "Final held-out reward minus `bypass`'s at the same K, paired by seed within a build: sampled / greedy, "
        "mean [95 % t CI]; italics: inside the noise",
        decoupled_text: "The correction alone: final held-out reward minus plain `decoupled`'s at the same K, "
        "paired by seed within a build: sampled / greedy; italics: inside the noise",
        anchors_text: "Both anchors at full lag: share of tokens with pi / mu outside 1 -+ 0.2 / the same "
        "for pi / pi_old (medians per run, mean over seeds) / largest pi / mu / largest IS weight",
    }
    lines: list[str] = []
    for fmt, title in titles.items():
        lines += ["", title, "", "| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for row in rows:
            out = [fmt(grid[(row, col)]) if (row, col) in grid else "" for col in cols]
            lines.append(f"| {row} | " + " | ".join(out) + " |")
    if any(c.get("other_build") for c in cells.values()):
        lines += [
            "",
            "(n of another build): n of the cell's runs began from another build of the warm start "
            "(a store read with --with-store); each is judged against its own build's start and "
            "paired only with runs of its build.",
        ]
    return "\n".join(lines[1:])


TRAJECTORY_KEYS = ("train/reward_ema", "train/kl_behavior", "train/clip_frac", "drift/score")


def plot_trajectories(runs: dict[str, list[dict[str, str]]], path: Path) -> None:
    """One line per run (label -> metrics rows) for each diagnostic over training steps (log
    scale for the KL)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TRAJECTORY_KEYS), figsize=(4.2 * len(TRAJECTORY_KEYS), 3.6))
    for label, rows in runs.items():
        rows = [r for r in rows if r.get("step") and r.get("train/loss")]
        for ax, key in zip(axes, TRAJECTORY_KEYS):
            pts = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
            ax.plot([p[0] for p in pts], [max(p[1], 1e-6) for p in pts], label=label, lw=1)
    for ax, key in zip(axes, TRAJECTORY_KEYS):
        ax.set_title(key)
        ax.set_xlabel("optimizer step")
        if key == "train/kl_behavior":
            ax.set_yscale("log")
            ax.axhline(0.2, color="k", ls=":", lw=0.8)  # the detector's ceiling
        if key == "drift/score":
            ax.axhline(DriftDetector().threshold, color="k", ls=":", lw=0.8)  # the default alarm threshold
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=7)
    fig.tight_layout(rect=(0, 0.06 + 0.03 * (len(labels) // 4), 1, 1))
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    parser.add_argument(
        "--arms", "--corrections", nargs="+", default=None, help=f"default {' '.join(ARMS)} (see ARMS)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--mismatch", action="store_true", help="bf16 engine at lag 0 instead of the grid")
    parser.add_argument("--controller", action="store_true", help="add callbacks/drift=controller")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--drop", type=float, default=0.15, help="reward-EMA drop that dates a collapse")
    parser.add_argument("--threshold", type=float, help="the detector's alarm threshold (default: its own)")
    parser.add_argument("--patience", type=int, help="steps over the threshold (default: the detector's)")
    parser.add_argument("--analyze", type=Path, help="only re-read the runs under this directory")
    parser.add_argument(
        "--replay", type=Path, nargs="+", help="only replay the detector on these finished runs (lag 0)"
    )
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown, not JSON")
    parser.add_argument(
        "--with-store",
        type=Path,
        nargs="+",
        default=[],
        help="read-only stores of other builds of the warm start, read beside --store (paired "
        "only within a build; never resumed nor appended to)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="skip the cells' seeds finished under --out or held by --store, rerun the rest",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "drift")
    parser.add_argument(
        "--store",
        type=Path,
        help="a committed JSONL of finished runs (lab/run_store.py): appended to as runs "
        "finish, skipped by --resume, read by --analyze with the run directories",
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    args = parser.parse_args()
    ctl = args.controller
    if args.mismatch:
        specs = [cell_spec(0, c, ["engine.dtype=bfloat16"], ctl) for c in args.arms or MISMATCH]
    else:
        specs = [cell_spec(k, c, None, ctl) for k in args.lags for c in args.arms or ARMS]
    if args.replay:  # false alarms on runs of any recipe (their metrics.csv)
        detector = {
            k: v for k, v in (("threshold", args.threshold), ("patience", args.patience)) if v is not None
        }
        runs = [r for r in args.replay if (r / "metrics.csv").exists()]
        alarms = {str(r): replay(read_metrics(r), 0, **detector) for r in runs}
        fired = {k: v for k, v in alarms.items() if v is not None}
        print(json.dumps({"runs": len(alarms), "alarmed": len(fired), "first_alarm": fired}))
        return
    out = args.analyze or args.out
    for path in args.with_store:  # read-only: a typo would silently read nothing
        if not path.exists():
            parser.error(f"--with-store {path}: no such file")
    paths = [p.resolve() for p in args.with_store] + ([args.store.resolve()] if args.store else [])
    if len(set(paths)) < len(paths):
        parser.error("--with-store names a store twice, or the --store itself: its runs would count twice")
    others = [run_store.load(p) for p in args.with_store]
    for other in others:  # another build of the same experiment, not another experiment
        check_setup(other, specs, {"overrides": args.overrides, "eval_every": args.eval_every})
    stored = run_store.load(args.store) if args.store else None
    if stored is not None:
        if not args.eval_every:
            parser.error("--store needs --eval-every > 0 (a run is stored once its held-out curve exists)")
        setup = {"overrides": args.overrides, "eval_every": args.eval_every, "commit": run_store.commit()}
        check_setup(stored, specs, setup)
        sweep(out, specs, args.seeds, args.store, stored, setup)
    if not args.analyze:
        for spec in specs:
            for seed in args.seeds:  # one at a time: each run is stored as soon as it ends
                with run_lock(out, spec, seed) as mine:
                    # another worker has it, or (decided under the lock) it is already done
                    if not mine or (args.resume and not pending_seeds(out, spec, [seed], stored)):
                        continue
                    results = run_recipe(
                        spec,
                        [seed],
                        out,
                        args.overrides,
                        args.eval_every,
                        prune_checkpoints=True,
                        keep_going=True,
                    )
                    if stored is not None:
                        archive(out, spec, results, args.store, stored, setup)
    detector = {
        k: v for k, v in (("threshold", args.threshold), ("patience", args.patience)) if v is not None
    }
    result = table(out, specs, args.seeds, args.drop, detector, stored, others)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    runs = {}
    for spec in specs:
        for seed in args.seeds:
            found = find_run(out, spec, seed, stored)
            if found is not None:
                runs[f"{short(spec)} s{seed}"] = found[0]
    if runs:
        plot_trajectories(runs, out / "trajectories.png")
    print(markdown(result["cells"], start_reward(out, stored)) if args.markdown else json.dumps(result))


if __name__ == "__main__":
    main()
