"""``lab.detector_eval``: the replay, the grid's shortcut and the scoring, on hand-made runs."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from lab.detector_candidates import (
    SHIPPED,
    EssThreshold,
    Traces,
    VcpoRule,
    detector_of,
    first_alarm,
    grid_configs,
    replayed,
    selective_alarms,
    vcpo_alarms,
)
from lab.detector_runs import Run, trained_steps
from lab.detector_score import ranked, score
from lab.drift_outcome import SLIDE_WARMUP, below_start_step, replay
from modules.callbacks.drift_score import DriftDetector


def rows(n: int, lag: int, seed: int, drift_at: int | None = None) -> list[dict[str, str]]:
    """metrics.csv rows: trained steps with a delayed sync's ramp to ``lag``, one evaluation
    row in between; from ``drift_at`` on the ESS falls, the entropy, KL and grad norm rise."""
    rng, out = random.Random(seed), []
    for t in range(n):
        k = max(0, t - drift_at) if drift_at is not None else 0
        m = {
            "step": t,
            "train/loss": 0.1,
            "rollout/staleness_max": min(t, lag),
            "is/ess_frac": min(1.0, rng.gauss(0.9, 0.02)) * math.exp(-0.05 * k),
            "train/entropy": 0.12 * math.exp(rng.gauss(0, 0.1) + 0.05 * k),
            "train/kl_behavior": 0.05 * math.exp(rng.gauss(0, 0.3) + 0.1 * k),
            "train/grad_norm": 0.5 * math.exp(rng.gauss(0, 0.3) + 0.05 * k),
            "train/clip_frac": max(0.0, rng.gauss(0.03, 0.01)),
            "is/weight_max": 3.0 * math.exp(rng.gauss(0, 0.2) + 0.1 * k),
        }
        out.append({key: str(v) for key, v in m.items()})
        if t == n // 2:
            out.append({"step": str(t), "eval/reward_mean": "0.5"})  # not a trained step
    return out


def run_of(
    r: list[dict[str, str]], lag: int, collapse: int | None, rule: str | None = "drop", seed: int = 1
) -> Run:
    return Run("x", "store", seed, lag, trained_steps(r, lag), collapse is not None, collapse, rule, 0.0)


def test_the_replay_feeds_what_the_monitor_feeds():
    for lag, drift_at in ((0, 30), (4, 25), (8, None)):
        r = rows(60, lag, seed=lag, drift_at=drift_at)
        run = run_of(r, lag, None)
        assert len(run.steps) == 60 and [learn for *_, learn in run.steps][: lag + 1] == [False] * lag + [
            True
        ]
        assert first_alarm(DriftDetector(**SHIPPED), run) == replay(r, lag, **SHIPPED)
        assert first_alarm(DriftDetector(), run) == replay(r, lag)


def test_the_grid_shortcut_agrees_with_a_replay_of_the_detector_it_stands_for():
    runs = [
        run_of(rows(50, lag, seed=s, drift_at=d), lag, None)
        for s, (lag, d) in enumerate([(0, 20), (2, None), (8, 30)])
    ]
    traces = Traces(runs)
    configs = grid_configs()
    assert len(configs) > 1000
    sample = configs[:: len(configs) // 60 | 1]  # an odd stride: both baselines come up
    assert {c["baseline"] for c in sample} == {"ramp", "first"}
    for config in sample:
        assert traces.alarms(config) == selective_alarms(config, runs), config


def test_a_baseline_learned_from_the_first_step_sees_a_drift_that_begins_during_the_ramp():
    """With several optimizer steps per batch a lag of K ramps over 4K steps: a drift that starts
    inside the ramp is already in a ``ramp`` baseline (learned after it) and the alarm comes
    late or never; a ``first`` baseline is learned before the drift and alarms sooner."""
    lag, drift_at = 32, 12
    r = rows(60, lag, seed=5, drift_at=drift_at)
    run = run_of(r, lag, collapse=40)
    config = {
        "signals": ["kl", "grad_norm"],
        "net": "none",
        "threshold": 3.0,
        "patience": 2,
        "alpha": 0.3,
        "warmup": 10,
        "baseline": "first",
    }
    first = selective_alarms(config, [run])[0]
    ramp = selective_alarms({**config, "baseline": "ramp"}, [run])[0]
    assert first is not None and drift_at < first < lag
    assert ramp is None or ramp > lag + 10  # no ramp baseline before step K + warmup
    assert first == first_alarm(detector_of(config), run, from_first=True)
    assert Traces([run]).alarms(config) == [first]
    vcpo = {"ess_drop": 0.9, "spike": 2.0, "window": 10}
    assert vcpo_alarms({**vcpo, "baseline": "ramp"}, [run]) == replayed(lambda: VcpoRule(**vcpo), [run])
    early = vcpo_alarms({**vcpo, "baseline": "first"}, [run])
    assert early == [first_alarm(VcpoRule(**vcpo), run, from_first=True)]
    assert early != vcpo_alarms({**vcpo, "baseline": "ramp"}, [run])


def test_scores_count_false_alarms_misses_and_leads_and_leave_undated_collapses_out():
    runs = [
        run_of([], 0, None),  # healthy, alarmed: a false alarm
        run_of([], 0, None),  # healthy, quiet
        run_of([], 0, 40),  # sharp collapse, alarmed 15 steps ahead
        run_of([], 0, 30, rule="below_start"),  # a slide, alarmed 5 steps late
        run_of([], 0, 50),  # missed
        Run("u", "store", 1, 0, [], True, None, None, 0.0),  # collapsed, never dated
    ]
    s = score(runs, [10, None, 25, 35, None, 3])
    assert (s["false_alarms"], s["healthy"], s["missed"], s["collapsed"], s["undated"]) == (1, 2, 1, 3, 1)
    assert s["leads"] == [-5, 15] and s["median_lead"] == 5 and s["timely"] == 1
    assert s["median_lead_sharp"] == 15 and s["sharp"] == "1/2 alarmed"
    # a run that ended just below the warm start (within --margin) is neither a collapse nor
    # healthy: its alarm is neither a false alarm nor a lead
    marginal = replace(run_of([], 0, 20), marginal=True)
    undated = replace(
        run_of([], 0, None), collapsed=True, rule=None, marginal=True
    )  # as load_runs makes them
    t = score([*runs, marginal, undated], [10, None, 25, 35, None, 3, 5, 7])
    assert {k: t[k] for k in s if k != "marginal"} == {k: s[k] for k in s if k != "marginal"}
    assert (s["marginal"], t["marginal"]) == (0, 2)


def test_the_rule_keeps_the_goal_then_the_most_timely_alarms():
    def s(fa, healthy, timely, med):
        return {"false_alarms": fa, "healthy": healthy, "timely": timely, "median_lead": med}

    entries = [
        ({"signals": ["a"], "threshold": 3}, s(2, 7, 20, 30)),  # too many false alarms
        ({"signals": ["a"], "threshold": 3}, s(0, 7, 20, 8)),  # lead below 10
        ({"signals": ["a", "b"], "threshold": 3}, s(1, 7, 12, 15)),
        ({"signals": ["a"], "threshold": 4}, s(1, 7, 12, 15)),  # same numbers, fewer signals
        ({"signals": ["a"], "threshold": 3}, s(0, 7, 11, 25)),
    ]
    order = ranked(entries)
    assert [e[0] for e in order] == [entries[3][0], entries[2][0], entries[4][0]]


def test_verl_and_vcpo_rules():
    assert not EssThreshold(0.3).update({"is/ess_frac": 1.0})  # bypass: nothing to see
    assert not EssThreshold(0.3).update({"train/grad_norm": 1.0})
    assert EssThreshold(0.3).update({"is/ess_frac": 0.2})
    rule = VcpoRule(ess_drop=0.5, spike=5.0, window=3, warmup=5)
    quiet = {"is/ess_frac": 0.9, "train/grad_norm": 1.0}
    assert not any(rule.update(quiet) for _ in range(10))
    assert not rule.update({"is/ess_frac": 0.9, "train/grad_norm": 10.0})  # a spike alone
    assert not rule.update(quiet) and rule.update({"is/ess_frac": 0.3, "train/grad_norm": 1.0})  # + a drop
    bypass = VcpoRule(ess_drop=0.5, spike=5.0, window=3, warmup=5)
    spikes = [{"is/ess_frac": 1.0, "train/grad_norm": 100.0 if t > 10 else 1.0} for t in range(20)]
    assert not any(bypass.update(m) for m in spikes)  # ESS at 1: the drop never comes


@pytest.mark.parametrize("lag", [0, 4])
def test_the_default_alarms_on_the_drift_and_not_before(lag):
    run = run_of(rows(60, lag, seed=3, drift_at=30), lag, 45)
    first = first_alarm(DriftDetector(), run)
    assert first is not None and 30 < first <= 40
    assert first_alarm(DriftDetector(), run_of(rows(60, lag, seed=3), lag, None)) is None


def test_evaluate_fits_on_lagged_runs_of_the_fit_seeds_only(monkeypatch, tmp_path):
    """Lag-0 runs and the extra stores are reported, never fitted on; a store where no grid
    point meets the goal still gets a report (flagged), not an exit."""
    import lab.detector_eval as de

    def made(store: Path, drop: float = 0.15, margin: float = 0.0) -> list[Run]:
        if store.name.startswith("grid"):
            runs = []
            for seed in (1, 2):
                for lag in (0, 4):
                    drift = 25 if lag else None
                    r = run_of(
                        rows(60, lag, seed=10 * seed + lag, drift_at=drift), lag, 45 if drift else None
                    )
                    runs.append(replace(r, seed=seed, name=f"K={lag} s{seed}", store="grid"))
            return runs
        return [replace(run_of(rows(60, 0, seed=99), 0, None), store="extra", name="bf16")]

    monkeypatch.setattr(de, "load_runs", made)
    result = de.evaluate([1], store=tmp_path / "grid.jsonl", extra=(tmp_path / "extra.jsonl",), top=1)
    c = result["candidates"]["default"]
    assert (
        c["fit"]["collapsed"],
        c["held_out"]["collapsed"],
        c["lag0"]["healthy"],
        c["extra"]["healthy"],
    ) == (
        1,
        1,
        2,
        1,
    )
    assert c["fit"]["healthy"] == 0 and c["held_out"]["healthy"] == 0  # lag-0 runs are never fitted on
    assert result["held_out_seeds"] == [2] and result["store"] == "grid.jsonl"
    assert "lag-0 runs" in de.markdown(result)
    # two stores: the lagged runs of the fit seed in both are fitted, the others held out
    both = de.evaluate([1], store=(tmp_path / "grid.jsonl", tmp_path / "grid2.jsonl"), extra=(), top=1)
    d = both["candidates"]["default"]
    assert (d["fit"]["collapsed"], d["held_out"]["collapsed"], d["lag0"]["healthy"]) == (2, 2, 4)
    assert both["store"] == "grid.jsonl, grid2.jsonl"
    with pytest.raises(SystemExit, match="more than once"):
        de.evaluate([1], store=(tmp_path / "grid.jsonl",), extra=(tmp_path / "a" / "grid.jsonl",))


def test_evaluate_reports_a_fallback_when_no_grid_point_meets_the_goal(monkeypatch, tmp_path):
    """A fit seed whose only collapse has no date: no median lead, so no point is feasible."""
    import lab.detector_eval as de

    def made(store: Path, drop: float = 0.15, margin: float = 0.0) -> list[Run]:
        r = rows(60, 4, seed=7, drift_at=25)
        undated = Run("K=4 s1", "grid", 1, 4, trained_steps(r, 4), True, None, None, 0.0)
        held = replace(run_of(r, 4, 45), seed=2, name="K=4 s2", store="grid")
        return [undated, held] if store.name == "grid.jsonl" else []

    monkeypatch.setattr(de, "load_runs", made)
    result = de.evaluate([1], store=tmp_path / "grid.jsonl", extra=(), top=3)
    assert result["candidates"]["selective"]["met_goal_on_fit"] is False
    assert result["grid"]["meet_goal_on_fit"] == 0 and result["grid"]["top"] == []
    text = de.markdown(result)
    assert "no selective setting met the goal" in text and "none meets the goal on the fit seeds" in text


def test_a_slide_dated_at_the_first_step_after_the_reference_window_is_counted_as_such():
    r = rows(30, 0, seed=5)
    # the slide rule's earliest possible date on these rows: a reward that falls at once
    falling = [dict(x, **{"train/reward_mean": "0.5", "train/reward_ema": "0.1"}) for x in r]
    first = below_start_step(falling)
    assert first == SLIDE_WARMUP
    early = run_of(r, 0, first, rule="below_start")
    later = run_of(r, 0, first + 1, rule="below_start")
    sharp = run_of(r, 0, 10, rule="drop")  # a sharp drop dated there is an onset in the record
    s = score([early, later, sharp], [None, None, None])
    assert s["dated_at_earliest"] == 1 and s["missed"] == 3
