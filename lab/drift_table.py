"""The drift grid's table: each cell's runs (from the store and the run directories) judged by
``lab.drift_outcome``, summed per cell, with paired differences between cells by seed.

Imported by ``lab.drift_grid`` (run that: ``python -m lab.drift_grid --analyze ...``), which
writes the ``table`` result to ``result.json`` and prints it (``lab.drift_report``: as Markdown).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from lab import bench_metrics
from lab.drift_cells import ARMS, arm_of, lag_of, spec_overrides
from lab.drift_outcome import outcome
from lab.drift_store import dir_run, find_run, start_reward


def seed_ci(pairs: list[tuple[int, float]]) -> dict:
    """``bench_metrics.per_seed_ci`` as the tables read it: ``(seed, difference)`` pairs (one per
    paired run; a seed can have several: two builds of the warm start, or several lags pooled)
    averaged within seed first, then the mean and 95 % t interval over seeds (None with fewer
    than 2 seeds); ``n`` counts seeds, ``n_pairs`` the pairs, ``inside_noise``: the interval
    holds 0."""
    ci = bench_metrics.per_seed_ci(bench_metrics.by_seed(pairs))
    lo, hi = ci["lo"], ci["hi"]
    interval = None if lo is None else [lo, hi]
    return {
        "mean": math.nan if ci["mean"] is None else ci["mean"],
        "ci": interval,
        "n": ci["n"],
        "n_pairs": ci["n_runs"],
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


def paired_runs(cells: dict[str, dict], reference: str, key: str = "final_sampled") -> dict[str, dict]:
    """Each cell's runs paired with its reference cell's: ``{spec: {"pairs": [(seed, x - y)],
    "via_alt": n}}``, ``key`` the final held-out sampled or greedy reward, pairs by seed within a
    build of the warm start (a run's ``build``: 0 for the store being written, i for the i-th
    ``--with-store``; never across builds). ``reference``: ``k0`` pairs a lagged cell with the
    same arm (and the same other overrides) at K = 0. A run of a corrected decoupled arm whose
    build has no K = 0 run of that arm pairs with plain ``decoupled``'s K = 0 run instead, where
    that is the same loss: a correction in ``IDENTITY_AT_K0`` (weight 1 where mu is pi_old) and
    an engine that agreed with the trainer in that run (``engine_matches_trainer``: not a bf16
    engine); ``via_alt`` counts those pairs. ``k0:<arm>`` pairs every cell with that arm's K = 0
    run (e.g. ``k0:bypass``: the shipped anchor's on-policy run as everyone's reference). An
    arm's name (``bypass``, ``decoupled``, ...) pairs a cell with that arm at the same K (and the
    same other overrides). Cells without a reference are left out."""
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
        elif reference in ARMS or reference.removeprefix("k0:") in ARMS:
            for k in ("algo/correction", "algo.loss.anchor", "algo/objective"):
                parts.pop(k, None)
            arm = reference.removeprefix("k0:")
            is_ref = arm_of(spec) == arm
            if reference.startswith("k0:"):
                parts.pop("callbacks.weight_sync.lag", None)
                is_ref = is_ref and lag_of(spec) == 0
        else:
            raise ValueError(f"reference must be 'k0', 'k0:<arm>' or an arm of {ARMS}, got {reference!r}")
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
        pairs, via_alt = [], 0
        for r in cell["runs"]:
            at = run_key(r)
            partner = refs.get(at) or alts.get(at)
            x, y = r.get(key, math.nan), (partner or {}).get(key, math.nan)
            if math.isfinite(x) and math.isfinite(y):
                pairs.append((r["seed"], x - y))
                via_alt += at not in refs
        if pairs:
            out[spec] = {"pairs": pairs, "via_alt": via_alt}
    return out


def paired(cells: dict[str, dict], reference: str, key: str = "final_sampled") -> dict[str, dict]:
    """Each cell's ``key`` minus its reference cell's (``paired_runs``), with the seed as the
    unit (``seed_ci``: a seed whose runs of two builds both pair is one value, their mean). Where
    a pair used plain ``decoupled``'s K = 0 run, the result's ``reference`` names it and
    ``reference_n`` counts those pairs."""
    out = {}
    for spec, p in paired_runs(cells, reference, key).items():
        out[spec] = seed_ci(p["pairs"])
        if p["via_alt"]:
            out[spec].update(reference="decoupled", reference_n=p["via_alt"])
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


def analyze_run(run_dir: Path, start: float, drop: float, detector: dict, lag: int = 0) -> dict:
    """One run directory's outcome (see ``outcome``)."""
    return outcome(*dir_run(run_dir), start, drop, detector, lag)


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
