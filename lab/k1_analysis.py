"""Why one version of lag (K = 1) is the worst lag at lr 3e-3: per-K diagnostics of the stored grid.

    python -m lab.k1_analysis                                     # prints JSON
    python -m lab.k1_analysis --store lab/results/drift_grid_3e-3.jsonl --window 15

Reads the stored runs of the lag x correction grid (``lab/run_store.py``: seeds 1 and 2; seed
0's run directories were not kept) and prints, per arm and lag K, means over seeds of per-run
statistics over the trained steps from K on (the first K steps are the ramp, staleness < K):

* ``final``: the held-out sampled reward per seed; ``learned``: seeds above the warm start;
* ``clip_frac``: the share of tokens whose PPO-clip gradient is zero. With one optimizer step
  per rollout batch the clip never limits the step being taken (pi = pi_old at the evaluation
  point); in bypass mode (pi_old := mu) it zeroes the tokens the *previous K* steps already
  moved out of 1 -+ 0.2 in the advantage's direction. That is a speed limit of about
  log(1.2) / K nats per version on a token pushed the same way (``speed_limit``): at K = 1 one
  step must leave the band on its own, which it rarely does. The decoupled anchor's clip never
  binds (0.00); its brakes are the correction's truncation (``zeroed_frac``, ``ess_frac``);
* ``kl_per_version``: median ``train/kl_behavior`` (KL between mu and pi, K versions apart) / K
  (exact at K = 1; at K > 1 it is the per-version KL if successive steps are uncorrelated);
  ``early_``: the same over the first ``--window`` steps after the ramp (before any collapse);
* ``grad_norm`` (median) and ``grad_clipped``: share of steps over ``gradient_clip_val`` = 1;
* the period-2 test: lag-1 autocorrelation of the linearly detrended ``train/reward_mean`` and
  ``train/kl_behavior`` (a period-2 oscillation gives values near -1; noise ~0);
* ``clip_benefit``: final reward of bypass minus decoupled ``token_is``, paired by seed. At the
  evaluation point both follow pi / mu * A * grad log pi; they differ only by the bypass clip
  (and its zeroed tokens), so this is what the clip buys at each K.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from lab import run_store
from lab.drift_cells import arm_of, lag_of

ROOT = Path(__file__).resolve().parents[1]
BAND = 0.2  # the shipped PPO clip


def _f(row: dict, key: str) -> float:
    v = row.get(key)
    return float(v) if v not in (None, "") else math.nan


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def acf1(xs: list[float]) -> float:
    """Lag-1 autocorrelation of ``xs`` after removing its least-squares line."""
    n = len(xs)
    t_mean, x_mean = (n - 1) / 2, statistics.fmean(xs)
    slope = sum((t - t_mean) * (x - x_mean) for t, x in enumerate(xs)) / sum(
        (t - t_mean) ** 2 for t in range(n)
    )
    r = [x - x_mean - slope * (t - t_mean) for t, x in enumerate(xs)]
    den = sum(v * v for v in r)
    return sum(a * b for a, b in zip(r, r[1:])) / den if den else math.nan


def run_stats(rec: dict, lag: int, window: int) -> dict[str, float]:
    rows = [r for r in rec["rows"] if r.get("train/loss")]
    post = rows[lag:]
    col = {k: [_f(r, k) for r in post] for k in ("train/kl_behavior", "train/grad_norm")}
    kl, gn = col["train/kl_behavior"], col["train/grad_norm"]
    return {
        "final": rec["last"]["eval/sampled_reward_mean"],
        "learned": float(rec["last"]["eval/sampled_reward_mean"] > rec["start_sampled"]),
        "clip_frac": _median([_f(r, "train/clip_frac") for r in post]),
        "zeroed_frac": _median([_f(r, "is/zeroed_frac") for r in post]),
        "ess_frac": _median([_f(r, "is/ess_frac") for r in post]),
        "kl_per_version": _median(kl) / lag,
        "early_kl_per_version": _median(kl[:window]) / lag,
        "grad_norm": _median(gn),
        "grad_clipped": sum(g > 1.0 for g in gn) / len(gn),
        "early_grad_clipped": sum(g > 1.0 for g in gn[:window]) / len(gn[:window]),
        "acf1_reward": acf1([_f(r, "train/reward_mean") for r in post]),
        "acf1_kl": acf1(kl),
    }


def analyze(store: Path, window: int) -> dict:
    cells: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    finals: dict[tuple[str, int, int], float] = {}
    for (spec, seed), rec in sorted(run_store.load(store).items(), key=lambda kv: kv[0][1]):
        if rec.get("error") or not rec.get("last"):
            continue
        lag = lag_of(spec)
        if lag > 0:
            cells[arm_of(spec)][lag].append(run_stats(rec, lag, window))
            finals[arm_of(spec), lag, seed] = rec["last"]["eval/sampled_reward_mean"]
    out: dict = {"store": str(store), "window": window, "cells": {}}
    for arm, by_lag in sorted(cells.items()):
        out["cells"][arm] = {}
        for lag, runs in sorted(by_lag.items()):
            cell = {"n": len(runs), "final": [round(r["final"], 3) for r in runs]}
            cell["learned"] = int(sum(r["learned"] for r in runs))
            for k in runs[0]:
                if k not in ("final", "learned"):
                    cell[k] = round(statistics.fmean(r[k] for r in runs), 4)
            out["cells"][arm][lag] = cell
    out["speed_limit"] = {lag: round(math.log(1 + BAND) / lag, 4) for lag in (1, 2, 4, 8)}
    out["clip_benefit"] = {}
    for (arm, lag, seed), final in sorted(finals.items()):
        if arm == "bypass" and ("token_is", lag, seed) in finals:
            diff = final - finals["token_is", lag, seed]
            out["clip_benefit"].setdefault(lag, {})[f"seed{seed}"] = round(diff, 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", type=Path, default=ROOT / "lab/results/drift_grid_3e-3.jsonl")
    p.add_argument("--window", type=int, default=15, help="steps after the ramp for the early_* stats")
    args = p.parse_args()
    print(json.dumps(analyze(args.store, args.window), indent=1))


if __name__ == "__main__":
    main()
