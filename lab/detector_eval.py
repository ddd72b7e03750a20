"""Drift detectors replayed offline on stored runs, chosen on some seeds and reported on the others.

    python -m lab.detector_eval --markdown                  # fit seed 1, report seed 2 (the default)
    python -m lab.detector_eval                             # the same as JSON, with every run's alarm
    python -m lab.detector_eval --fit-seeds 2 --markdown    # the other fold
    python -m lab.detector_eval --store lab/results/lag_grid_mb4_2e-3_b2.jsonl --extra ... --markdown
                                                            # any other grid store (its lag-0 runs never fitted)
    python -m lab.detector_eval --store lab/results/lag_grid_mb4_2e-3_dense.jsonl --margin 0.05 ...
                                                            # collapses dated on a dense held-out curve
    python -m lab.detector_eval --store A.jsonl B.jsonl ... # several stores: fit on all their fit seeds

Runs: ``lab/results/drift_grid_3e-3.jsonl`` (sync_grpo with a delayed sync of lag K in {1, 2, 4,
8} x 7 arms x seeds 1-2, lr 3e-3, 60 steps; the store holds no seed 0) and, never fitted on,
``lab/results/drift_mismatch_2e-3.jsonl`` (bf16 engine at lag 0, seeds 0-2, none collapses).
Outcomes are ``lab.drift_outcome.outcome``'s: collapse = final held-out sampled reward below the warm
start's (or stopped on non-finite losses), dated on the held-out curve where the store has one
evaluated between the run's ends (``heldout``: ``lab/results/lag_grid_mb4_2e-3_dense.jsonl``,
every 4 steps), else from ``train/reward_ema``; lead = collapse step - first alarm; a false
alarm is an alarm in a run that did not collapse. A collapse the rule could not date is left out
of the lead and miss counts (``undated``). ``--margin m``: a run ending below the warm start by
at most m is ``marginal``, neither a collapse nor healthy (not scored). Each detector is fed
what the drift monitor feeds it (trained steps; the baseline from the step the lag reached K,
or, for the grid points with ``baseline first``, from the first trained step).

Candidates: ``shipped`` (``DriftDetector`` with the defaults before issue 38), ``verl_ess_*``
(the ESS fraction of the IS weights under verl's thresholds: above 0.5 fine, below 0.3 warn),
``vcpo`` (VCPO's diagnosis, Huang et al. 2026: a fall of the ESS fraction together with a
gradient-norm spike; its parameters chosen on the fit seeds), ``selective`` (a
``DriftDetector`` configuration chosen on the fit seeds from ``GRID``) and ``default`` (whatever
``modules.callbacks.drift_score`` ships now). The ESS fraction is 1.0 in every bypass run (no IS
weight): ESS rules cannot see those runs at all.

Selection rule, on the fit seeds only: false alarms <= 1/6 of the healthy runs and a median lead
>= 10 steps; then the most collapses alarmed >= 10 steps ahead ("timely"), then fewer false
alarms, a longer median lead, fewer signals, a higher threshold, a longer patience. The rule picks
from ``GRID``; the grid itself (which signals, their ``min_scale``, the nets) was drawn up after
exploratory looks at both seeds, so the held-out numbers are not fully blind; ``baseline first``
was added after a look at the 2e-3 set's fit seed (of two configurations that differ only in it,
``ramp`` ranks first).
With 5-7 healthy and ~22 collapsed runs per seed they are counts, not rates; ``--fit-seeds 2``
runs the other fold.

This file is the command line and ``evaluate`` (fit, then report); the parts are in
``lab.detector_runs`` (a store -> ``Run``s), ``lab.detector_candidates`` (the detectors and their
replay), ``lab.detector_score`` (alarms -> counts, the selection rule) and
``lab.detector_report`` (the result as Markdown).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from lab.detector_candidates import (
    GRID,
    NETS,
    SHIPPED,
    VARIANTS,
    VCPO_GRID,
    EssThreshold,
    Traces,
    grid_configs,
    replayed,
    selective_alarms,
    vcpo_alarms,
)
from lab.detector_report import markdown
from lab.detector_runs import load_runs
from lab.detector_score import ess_blind, fallback, feasible, ranked, score
from modules.callbacks.drift_score import DriftDetector

ROOT = Path(__file__).resolve().parents[1]
GRID_STORE = ROOT / "lab" / "results" / "drift_grid_3e-3.jsonl"
EXTRA_STORES = (ROOT / "lab" / "results" / "drift_mismatch_2e-3.jsonl",)


def evaluate(
    fit_seeds: list[int],
    drop: float = 0.15,
    top: int = 8,
    store: Path | tuple[Path, ...] = GRID_STORE,
    extra: tuple[Path, ...] = EXTRA_STORES,
    margin: float = 0.0,
) -> dict:
    """Candidates fitted on the lagged runs of ``fit_seeds`` in ``store`` (one store or several),
    reported on their other seeds' lagged runs, on their lag-0 runs and on the ``extra`` stores
    (both never fitted on)."""
    stores = (store,) if isinstance(store, Path) else tuple(store)
    stems = [s.stem for s in (*stores, *extra)]
    if len(set(stems)) < len(stems):
        twice = sorted({x for x in stems if stems.count(x) > 1})
        raise SystemExit(f"--store / --extra name {twice} more than once: its runs would count twice")
    stored = [r for s in stores for r in load_runs(s, drop, margin)]
    runs = [r for r in stored if r.lag > 0]
    lag0 = [r for r in stored if r.lag == 0]
    every = runs + lag0 + [r for s in extra for r in load_runs(s, drop, margin)]
    fit = [r for r in runs if r.seed in fit_seeds]
    groups = {
        "fit": fit,
        "held_out": [r for r in runs if r.seed not in fit_seeds],
        "lag0": lag0,
        "extra": every[len(stored) :],
    }

    def report(config: dict, alarms: list[int | None]) -> dict:
        by_run = dict(zip(map(id, every), alarms))
        out = {"config": config}
        for name, group in groups.items():
            out[name] = score(group, [by_run[id(r)] for r in group])
        out["goal_met_held_out"] = feasible(out["held_out"])
        out["runs"] = {f"{r.name} {r.store}": a for r, a in zip(every, alarms)}
        return out

    cands: dict[str, dict] = {}
    cands["shipped"] = report(
        {"DriftDetector": "defaults before issue 38"}, replayed(lambda: DriftDetector(**SHIPPED), every)
    )
    for name, level in (("verl_ess_warn", 0.3), ("verl_ess_fine", 0.5)):
        cands[name] = report(
            {"is/ess_frac below": level}, replayed(lambda level=level: EssThreshold(level), every)
        )
    vcpo = [dict(zip(VCPO_GRID, k)) for k in itertools.product(*VCPO_GRID.values())]
    vcpo_fit = [(c, score(fit, vcpo_alarms(c, fit))) for c in vcpo]
    vcpo_best = ranked(vcpo_fit) or fallback(vcpo_fit)
    cands["vcpo"] = report(vcpo_best[0][0], vcpo_alarms(vcpo_best[0][0], every))
    cands["vcpo"]["met_goal_on_fit"] = feasible(vcpo_best[0][1])
    traces = Traces(fit)
    grid = [(c, score(fit, traces.alarms(c))) for c in grid_configs()]
    order = ranked(grid)
    best = (order or fallback(grid))[0][0]
    alarms = selective_alarms(best, every)
    by_run = dict(zip(map(id, every), alarms))
    if [by_run[id(r)] for r in fit] != traces.alarms(best):
        raise SystemExit("the grid's shortcut and a DriftDetector replay disagree")  # a bug, not a result
    cands["selective"] = report(best, alarms)
    cands["selective"]["met_goal_on_fit"] = bool(order)
    cands["default"] = report({"DriftDetector": "defaults now"}, replayed(DriftDetector, every))
    return {
        "store": ", ".join(s.name for s in stores),
        "extra": [s.name for s in extra],
        "fit_seeds": fit_seeds,
        "margin": margin,
        "held_out_seeds": sorted({r.seed for r in groups["held_out"]}),
        "ess_blind_collapses": {
            name: sum(r.collapsed and not r.marginal and ess_blind(r) for r in group)
            for name, group in groups.items()
        },
        "candidates": cands,
        "grid": {
            "size": len(grid),
            "meet_goal_on_fit": len(order),
            "variants": {v: vars(s) for v, s in VARIANTS.items()},
            "nets": NETS,
            "knobs": GRID,
            "vcpo": VCPO_GRID,
            "top": [
                {
                    "config": c,
                    "fit": s,
                    "held_out": report(c, selective_alarms(c, every))["held_out"],
                }
                for c, s in order[:top]
            ],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit-seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--drop", type=float, default=0.15, help="reward-EMA drop that dates a collapse")
    parser.add_argument(
        "--margin",
        type=float,
        default=0.0,
        help="a run ending below the warm start by at most this is marginal: not scored",
    )
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument(
        "--store",
        type=Path,
        nargs="+",
        default=[GRID_STORE],
        help="the runs fitted on (lagged, fit seeds) and held out (lagged, other seeds)",
    )
    parser.add_argument(
        "--extra", type=Path, nargs="*", default=list(EXTRA_STORES), help="stores never fitted on"
    )
    args = parser.parse_args()
    result = evaluate(
        args.fit_seeds, args.drop, store=tuple(args.store), extra=tuple(args.extra), margin=args.margin
    )
    print(markdown(result) if args.markdown else json.dumps(result))


if __name__ == "__main__":
    main()
