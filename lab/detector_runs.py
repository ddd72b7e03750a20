"""Stored drift-grid runs as the detector evaluation replays them: a store's runs -> ``Run``s, each
with its trained steps (what the drift monitor feeds a detector) and ``lab.drift_outcome``'s
verdict (collapsed, when, by which rule).

Imported by ``lab.detector_eval`` (run that: ``python -m lab.detector_eval --markdown``) and
the other ``lab.detector_*`` modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lab import run_store
from lab.drift_cells import arm_of, lag_of
from lab.drift_outcome import outcome
from lab.drift_store import start_reward


@dataclass
class Run:
    name: str
    store: str
    seed: int
    lag: int
    steps: list[tuple[int, dict[str, float], bool]]  # trained steps: (step, metrics, learn)
    collapsed: bool
    collapse_step: int | None
    rule: str | None
    final: float
    marginal: bool = False  # ended below the warm start by at most ``--margin``: not scored


def trained_steps(rows: list[dict[str, str]], lag: int) -> list[tuple[int, dict[str, float], bool]]:
    """What the monitor feeds the detector (``lab.drift_outcome.replay``'s walk): trained steps,
    ``learn`` once the delayed sync's staleness reached K."""
    by_step: dict[int, dict[str, float]] = {}
    for r in rows:
        if r.get("step"):
            by_step.setdefault(int(r["step"]), {}).update(
                {k: float(v) for k, v in r.items() if v not in ("", None)}
            )
    out, ramped = [], lag == 0
    for step in sorted(by_step):
        m = by_step[step]
        if "train/loss" in m:
            ramped = ramped or m.get("rollout/staleness_max", 0.0) >= lag
            out.append((step, m, ramped))
    return out


def load_runs(store: Path, drop: float = 0.15, margin: float = 0.0) -> list[Run]:
    """A store's runs with ``lab.drift_outcome.outcome``'s verdicts (against the warm start the
    store's own runs began from). ``margin``: a run whose final held-out reward is below the
    warm start by at most this is ``marginal`` (neither a collapse nor a healthy run)."""
    stored = run_store.load(store)
    start = start_reward(None, stored)  # the store's evaluations only
    runs = []
    for (spec, seed), rec in sorted(
        stored.items(), key=lambda kv: (lag_of(kv[0][0]), arm_of(kv[0][0]), kv[0][1])
    ):
        lag = lag_of(spec)
        o = outcome(rec["rows"], rec["last"], rec.get("curve"), start, drop, {}, lag)
        run = Run(
            name=f"K={lag} {arm_of(spec)} s{seed}",
            store=store.stem,
            seed=seed,
            lag=lag,
            steps=trained_steps(rec["rows"], lag),
            collapsed=o["collapsed"],
            collapse_step=o["collapse_step"],
            rule=o["collapse_rule"],
            final=o["final_sampled"],
            marginal=o["collapsed"] and o["final_sampled"] >= start - margin,
        )
        runs.append(run)
    return runs
