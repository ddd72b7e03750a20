"""Scoring a detector's alarms on ``Run``s: false alarms, missed and timely collapses, lead
times; the goal on the fit seeds and the order the selection rule ranks by.

Imported by ``lab.detector_eval`` (run that: ``python -m lab.detector_eval --markdown``), whose
docstring states the selection rule. Runs and alarm steps in, counts out.
"""

from __future__ import annotations

import statistics

from lab.detector_runs import Run
from lab.drift_outcome import SLIDE_WARMUP

TIMELY = 10  # steps of lead that count as an early warning


def at_earliest(run: Run) -> bool:
    """A slide dated at the first step ``below_start_step`` can give (the first trained step
    after its reference window). Such a date says the training reward's EMA was below the
    window's mean reward when the window closed, not that the run had begun to fall: the EMA
    (alpha 0.1, seeded with the first batch's reward) can still be catching up then, and with
    several optimizer steps per batch it moves once per batch. No alarm can lead such a date
    by more than the window."""
    steps = [s for s, _, _ in run.steps]
    return (
        run.rule == "below_start" and len(steps) > SLIDE_WARMUP and run.collapse_step <= steps[SLIDE_WARMUP]
    )


def score(runs: list[Run], alarms: list[int | None]) -> dict:
    """False alarms / healthy runs, missed and alarmed dated collapses, their lead times."""
    healthy = [a for r, a in zip(runs, alarms) if not r.collapsed]
    dated = [
        (r, a) for r, a in zip(runs, alarms) if r.collapsed and not r.marginal and r.collapse_step is not None
    ]
    leads = sorted(r.collapse_step - a for r, a in dated if a is not None)
    sharp = sorted(r.collapse_step - a for r, a in dated if a is not None and r.rule == "drop")
    return {
        "healthy": len(healthy),
        "false_alarms": sum(a is not None for a in healthy),
        "collapsed": len(dated),
        "undated": sum(r.collapsed and not r.marginal and r.collapse_step is None for r in runs),
        "marginal": sum(r.marginal for r in runs),
        "missed": sum(a is None for _, a in dated),
        "timely": sum(x >= TIMELY for x in leads),
        "median_lead": statistics.median(leads) if leads else None,
        "leads": leads,
        # collapses dated by the reward EMA's drop (a sharp fall), not by a slide below the start
        "median_lead_sharp": statistics.median(sharp) if sharp else None,
        "sharp": f"{len(sharp)}/{sum(r.rule == 'drop' for r, _ in dated)} alarmed",
        # dates at the earliest step the slide rule can give (``at_earliest``): no alarm can lead them
        "dated_at_earliest": sum(at_earliest(r) for r, _ in dated),
    }


def feasible(s: dict) -> bool:
    """The goal on the fit seeds: false alarms <= 1/6 of the healthy runs, median lead >= 10."""
    return (
        s["false_alarms"] * 6 <= s["healthy"] and s["median_lead"] is not None and s["median_lead"] >= TIMELY
    )


def ranked(entries: list[tuple[dict, dict]]) -> list[tuple[dict, dict]]:
    """(config, fit score) pairs that meet the goal, best first (see the module docstring)."""

    def key(entry: tuple[dict, dict]) -> tuple:
        config, s = entry
        return (
            -s["timely"],
            s["false_alarms"],
            -s["median_lead"],
            len(config.get("signals", ())),
            -config.get("threshold", 0),
            -config.get("patience", 0),
        )

    return sorted((e for e in entries if feasible(e[1])), key=key)


def fallback(entries: list[tuple[dict, dict]]) -> list[tuple[dict, dict]]:
    """(config, fit score) pairs when none meets the goal: the fewest false alarms, then the most
    timely alarms."""
    return sorted(entries, key=lambda e: (e[1]["false_alarms"], -e[1]["timely"]))


def ess_blind(run: Run) -> bool:
    """A run whose ESS fraction never leaves 1 (bypass: no IS weight): ESS rules see nothing."""
    return all(m.get("is/ess_frac", 1.0) == 1.0 for _, m, _ in run.steps)
