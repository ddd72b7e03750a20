"""How ``lab.drift_grid`` dates a collapse and scores the detector, on hand-made metrics.csv."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import pytest

from lab.drift_outcome import below_start_step, collapse_step
from lab.drift_table import analyze_run

FIELDS = ["step", "train/loss", "train/reward_mean", "train/reward_ema", "controller/notches"]


def rows_of(rewards: list[float]) -> list[dict[str, str]]:
    """Trained steps 0..n-1 with the module's own EMA (0.9 / 0.1) of the batch reward."""
    rows, ema = [], None
    for step, r in enumerate(rewards):
        ema = r if ema is None else 0.9 * ema + 0.1 * r
        rows.append(
            {
                "step": str(step),
                "train/loss": "0.1",
                "train/reward_mean": str(r),
                "train/reward_ema": str(ema),
            }
        )
    return rows


def write_run(run_dir: Path, rows: list[dict[str, str]], final: float | None) -> Path:
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.csv", "w", newline="") as f:
        extra = [k for r in rows for k in r if k not in FIELDS]
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys([*FIELDS, *extra])))
        writer.writeheader()
        writer.writerows(rows)
    if final is not None:
        (run_dir / "eval_summary.json").write_text(json.dumps({"last": {"eval/sampled_reward_mean": final}}))
    return run_dir


def test_a_sharp_drop_is_dated_by_the_drop_rule():
    rows = rows_of([0.5] * 20 + [0.0] * 20)
    step = collapse_step(rows, drop=0.15)
    assert step == 23  # the EMA 0.5 * 0.9^k first <= 0.5 - 0.15 at k = 4
    assert below_start_step(rows) == 20


def test_a_slow_slide_is_dated_where_it_stays_below_its_start():
    # up to 0.55, then a slow slide to 0.40: never 0.15 below the peak, but below the start
    rewards = [0.45] * 10 + [0.55] * 10 + [0.55 - 0.005 * k for k in range(40)]
    rows = rows_of(rewards)
    assert collapse_step(rows, drop=0.15) is None
    step = below_start_step(rows)
    ema = {int(r["step"]): float(r["train/reward_ema"]) for r in rows}
    start = sum(rewards[:10]) / 10
    assert step is not None and all(ema[s] < start for s in range(step, len(rewards)))
    assert ema[step - 1] >= start  # the first step of the final stretch below the start


def test_a_slide_is_never_dated_inside_the_reference_window():
    # a low first reward keeps the EMA under the first 10 steps' raw mean from step 0 on
    rows = rows_of([0.1] + [0.5] * 9 + [0.3] * 30)
    assert below_start_step(rows) == 10
    assert below_start_step(rows_of([0.5] * 9)) is None  # too short to have a reference


def test_a_dip_that_recovers_is_not_a_slide():
    rows = rows_of([0.5] * 10 + [0.3] * 10 + [0.6] * 10)
    assert below_start_step(rows) is None


def test_analyze_run_names_the_rule_that_dated_the_collapse(tmp_path):
    slide = [0.45] * 10 + [0.55] * 10 + [0.55 - 0.005 * k for k in range(40)]
    out = analyze_run(write_run(tmp_path / "slide", rows_of(slide), 0.30), 0.39, 0.15, {"threshold": 4.0})
    assert out["collapsed"] and out["collapse_rule"] == "below_start" and out["collapse_step"] is not None
    sharp = analyze_run(write_run(tmp_path / "sharp", rows_of([0.5] * 20 + [0.0] * 20), 0.0), 0.39, 0.15, {})
    assert sharp["collapse_rule"] == "drop"
    stopped = analyze_run(write_run(tmp_path / "stopped", rows_of([0.5] * 12), None), 0.39, 0.15, {})
    assert stopped["collapsed"] and stopped["collapse_rule"] == "stopped" and stopped["collapse_step"] == 11
    healthy = analyze_run(write_run(tmp_path / "healthy", rows_of([0.5] * 30), 0.6), 0.39, 0.15, {})
    assert not healthy["collapsed"] and healthy["collapse_step"] is None and healthy["collapse_rule"] is None
    assert healthy["first_alarm"] is None and not healthy["false_alarm"] and not healthy["acted"]
    steered = rows_of([0.5] * 30)
    steered[12]["controller/notches"] = "1"
    out = analyze_run(write_run(tmp_path / "steered", steered, 0.6), 0.39, 0.15, {"threshold": 4.0})
    assert out["acted"] and out["false_alarm"] is None  # whatever the replay says


def test_a_collapse_with_a_dense_heldout_curve_is_dated_on_it_not_on_the_training_reward(tmp_path):
    """The training reward stays flat (no EMA rule could date anything); the held-out curve
    dips below the start at 8, recovers at 12, and stays below from 16: dated 16. A curve with
    its end points only leaves the old rules in charge. The store keeps the curve, and a stored
    run is dated as its directory is."""
    from lab import run_store
    from lab.drift_outcome import HELDOUT_MARGIN, heldout_step, outcome
    from lab.drift_store import find_run

    start = 0.39
    curve = [(0, 0.39), (4, 0.40), (8, 0.38), (12, 0.41), (16, 0.30), (20, 0.10), (24, 0.05)]
    history = [
        {"step": s, "eval/sampled_reward_mean": x, "eval/reward_mean": 0.9, "samples": 1.0} for s, x in curve
    ]
    assert heldout_step(history, start) == 15  # checkpoint 16: made by the update of row 15
    assert heldout_step(history[:1] + history[-1:], start) is None  # the ends only: no date from it
    assert heldout_step(history[:1] + history[-2:], start) == 19
    assert (
        heldout_step(history[:-2] + [dict(history[-1], **{"eval/sampled_reward_mean": 0.5})], start) is None
    )
    # a first dip just below the start that never quite recovers, then the fall: the margin
    # dates the fall, not the dip; a run ending within the margin has no held-out date
    dip = [(0, 0.39), (4, 0.355), (8, 0.37), (12, 0.36), (16, 0.28), (20, 0.2)]
    dip = [{"step": s, "eval/sampled_reward_mean": x} for s, x in dip]
    assert heldout_step(dip, start) == 3 and heldout_step(dip, start - HELDOUT_MARGIN) == 15
    near = dip[:4]
    assert outcome(rows_of([0.5] * 13), near[-1], near, start, 0.15, {})["collapse_rule"] is None

    rows = rows_of([0.5] * 25)
    run = write_run(tmp_path / "dense" / "seed0", rows, None)
    summary = {"first": history[0], "last": history[-1], "history": history}
    (run / "eval_summary.json").write_text(json.dumps(summary))
    out = analyze_run(run, start, 0.15, {})
    assert out["collapsed"] and (out["collapse_rule"], out["collapse_step"]) == ("heldout", 15)

    ends = write_run(tmp_path / "ends" / "seed0", rows_of([0.5] * 20 + [0.0] * 5), None)
    (ends / "eval_summary.json").write_text(json.dumps({**summary, "history": [history[0], history[-1]]}))
    assert analyze_run(ends, start, 0.15, {})["collapse_rule"] == "drop"

    rec = run_store.record(run, "sync_grpo:a=1", 0, {"overrides": [], "eval_every": 1, "commit": "x"})
    assert [p["step"] for p in rec["curve"]] == [s for s, _ in curve] and "samples" not in rec["curve"][0]
    stored = {("sync_grpo:a=1", 0): json.loads(json.dumps(rec))}
    rows2, last2, curve2 = find_run(tmp_path / "nowhere", "sync_grpo:a=1", 0, stored)
    again = outcome(rows2, last2, curve2, start, 0.15, {})
    assert (again["collapse_rule"], again["collapse_step"]) == ("heldout", 15)
    old = {k: v for k, v in rec.items() if k != "curve"}  # a record written before the curve
    assert find_run(tmp_path / "nowhere", "sync_grpo:a=1", 0, {("sync_grpo:a=1", 0): old})[2] == []


def test_the_dashboard_plots_a_posthoc_curve_only_when_the_run_has_no_inline_evaluation(tmp_path):
    from tools.report import posthoc_points, render

    run = write_run(tmp_path / "run", rows_of([0.4] * 5), 0.5)
    points = [
        {
            "step": 0,
            "train_wall_s": 0.0,
            "samples": 0.0,
            "eval/reward_mean": 0.99,
            "eval/sampled_reward_mean": 0.38,
        },
        {
            "step": 4,
            "train_wall_s": 9.5,
            "samples": 640.0,
            "eval/reward_mean": 0.8,
            "eval/sampled_reward_mean": 0.49,
        },
    ]
    (run / "heldout_curve.json").write_text(json.dumps({"points": points}))
    got = posthoc_points(run, [])
    assert [(p["step"], p["perf/wall_s"], p["eval/sampled_reward_mean"]) for p in got] == [
        (0, 0.0, 0.38),
        (4, 9.5, 0.49),
    ]
    assert posthoc_points(run, [{"step": 4.0, "eval/reward_mean": 0.7}]) == []  # inline evaluation wins
    assert render(run, run / "dashboard.png").stat().st_size > 0


def test_diagnostics_are_medians_at_full_lag_and_the_largest_weight(tmp_path):
    from lab.drift_outcome import diagnostics

    rows = rows_of([0.5] * 6)
    for i, r in enumerate(rows):  # a delayed sync's ramp: staleness min(step, 2)
        r.update(
            {"rollout/staleness_max": str(min(i, 2)), "is/ess_frac": str(0.1 * i), "is/weight_max": str(i)}
        )
    rows[1]["is/weight_max"] = "99"  # inside the ramp: not the steady state's
    d = diagnostics(rows, lag=2)
    assert abs(d["is/ess_frac"] - 0.35) < 1e-12  # median of steps 2..5: 0.2, 0.3, 0.4, 0.5
    assert d["is/weight_max"] == 5.0
    assert "train/kl_behavior" not in d  # not logged: absent (a table shows nan), not 0


def test_arms_separate_anchor_clip_and_correction_and_pair_each_lag_with_k0():
    """Each arm's spec differs from the others in what its name says, ``arm_of`` inverts
    ``cell_spec`` (the old ``none`` is ``bypass``), and ``add_paired_differences`` pairs by seed."""
    from lab.drift_cells import ARMS, arm_of, cell_spec, spec_overrides
    from lab.drift_table import add_paired_differences

    specs = {arm: spec_overrides(cell_spec(4, arm)) for arm in ARMS}
    assert specs["bypass_noclip"] == {**specs["bypass"], "algo/objective": "reinforce"}
    assert specs["decoupled"] == {**specs["bypass"], "algo.loss.anchor": "decoupled"}
    assert specs["tis"] == {**specs["decoupled"], "algo/correction": "tis"}
    assert all(arm_of(cell_spec(k, a)) == a for a in ARMS for k in (0, 2))
    assert cell_spec(1, "none") == cell_spec(1, "bypass")  # the stored grid's specs still match
    cells = {
        cell_spec(0, "tis"): {"runs": [{"seed": 0, "final_sampled": 0.5}, {"seed": 1, "final_sampled": 0.7}]},
        cell_spec(2, "tis"): {"runs": [{"seed": 1, "final_sampled": 0.6}, {"seed": 0, "final_sampled": 0.2}]},
        cell_spec(2, "bypass"): {"runs": [{"seed": 0, "final_sampled": 0.1}]},  # no K = 0: unpaired
    }
    add_paired_differences(cells)
    p = cells[cell_spec(2, "tis")]["vs_k0"]
    assert p["n"] == 2 and abs(p["mean"] - (-0.3 - 0.1) / 2) < 1e-12
    # diffs -0.3, -0.1: sd 0.1414, half-width 12.706 * 0.1414 / sqrt(2) = 1.2706
    assert abs(p["ci"][1] - p["ci"][0] - 2 * 1.2706) < 1e-3 and p["inside_noise"]
    assert "vs_k0" not in cells[cell_spec(2, "bypass")] and "vs_k0" not in cells[cell_spec(0, "tis")]


def test_a_corrected_arm_without_its_own_k0_pairs_with_plain_decoupled_at_k0_and_says_so():
    """At K = 0 mu is pi_old, so every decoupled arm computes plain ``decoupled``'s loss: a
    corrected arm with no K = 0 cell of its own is paired with that one, and the result (and its
    table entry) names the reference; an arm with its own K = 0 cell, and the bypass arms, never
    fall back."""
    from lab.drift_cells import cell_spec
    from lab.drift_report import ci_text
    from lab.drift_table import add_paired_differences

    def cell(*runs, gap=1e-5):
        return {
            "runs": [
                {
                    "seed": s,
                    "final_sampled": f,
                    "greedy": f,
                    "diagnostics": {"mismatch/max_abs_logp_diff": gap},
                }
                for s, f in runs
            ]
        }

    cells = {
        cell_spec(0, "decoupled"): cell((0, 0.5), (1, 0.6)),
        cell_spec(0, "tis"): cell((0, 0.9), (1, 0.9)),
        cell_spec(4, "tis"): cell((0, 0.8), (1, 0.7)),  # its own K = 0 cell
        cell_spec(4, "tseq_is"): cell((0, 0.7), (1, 0.5)),  # none: plain decoupled's
        cell_spec(4, "decoupled"): cell((0, 0.6), (1, 0.6)),
        cell_spec(4, "bypass_noclip"): cell((0, 0.1), (1, 0.1)),  # never paired with another arm
        cell_spec(4, "tseq_is", ["algo.epochs=2"]): cell((0, 0.1), (1, 0.1)),  # no K = 0 with epochs=2
    }
    add_paired_differences(cells)
    t = cells[cell_spec(4, "tseq_is")]["vs_k0"]
    assert abs(t["mean"] - (0.2 - 0.1) / 2) < 1e-12 and t["reference"] == "decoupled"
    assert "(vs decoupled)" in ci_text(t)
    own = cells[cell_spec(4, "tis")]["vs_k0"]
    assert abs(own["mean"] - (-0.1 - 0.2) / 2) < 1e-12 and "reference" not in own
    assert "(vs" not in ci_text(own)
    assert "vs_k0" not in cells[cell_spec(4, "bypass_noclip")]
    assert "vs_k0" not in cells[cell_spec(4, "tseq_is", ["algo.epochs=2"])]
    assert "vs_k0" not in cells[cell_spec(0, "tis")]  # K = 0 itself is never paired
    assert "reference" not in cells[cell_spec(4, "tseq_is")]["vs_decoupled"]

    # per build: a build without the arm's own K = 0 run falls back, one with it does not
    def built(build, *runs):
        c = cell(*runs)
        for r in c["runs"]:
            r["build"] = build
        return c

    # (seed 0 pairs in both builds: +0.1 against its own K = 0, +0.3 against decoupled's; the
    # seed is the unit, so seed 0 counts once, as +0.2, beside seed 1's +0.3)
    mixed = {
        cell_spec(0, "decoupled"): {
            "runs": built(0, (0, 0.5), (1, 0.6))["runs"] + built(1, (0, 0.4))["runs"]
        },
        cell_spec(0, "tis"): built(0, (0, 0.6), (1, 0.5)),
        cell_spec(4, "tis"): {"runs": built(0, (0, 0.7), (1, 0.8))["runs"] + built(1, (0, 0.7))["runs"]},
    }
    add_paired_differences(mixed)
    m = mixed[cell_spec(4, "tis")]["vs_k0"]
    assert m["n"] == 2 and m["n_pairs"] == 3 and m["reference_n"] == 1
    assert abs(m["mean"] - (0.2 + 0.3) / 2) < 1e-12  # pooled as 3 independent pairs: 0.2333
    assert ci_text(m).endswith("(vs decoupled for 1 of 3 pairs)")

    # not where the K = 0 loss differs: a correction that is not 1 at pi_old = mu, an engine
    # that disagreed with the trainer (bf16), or a reference run that did not log the gap
    for gap, arm in ((1e-5, "ds_seq_mask"), (3.0, "tis"), (math.nan, "tis")):
        cells = {cell_spec(0, "decoupled"): cell((0, 0.5), gap=gap), cell_spec(4, arm): cell((0, 0.7))}
        add_paired_differences(cells)
        assert "vs_k0" not in cells[cell_spec(4, arm)], (gap, arm)


def test_cells_pair_with_bypass_and_decoupled_at_the_same_lag_for_both_rewards():
    """``vs_bypass`` pairs any arm with ``bypass`` at its own K (never across K or across other
    overrides), ``vs_decoupled`` only the corrected arms with plain ``decoupled``; sampled and
    greedy each."""
    from lab.drift_cells import cell_spec
    from lab.drift_table import add_paired_differences

    def cell(*runs):
        return {"runs": [{"seed": s, "final_sampled": f, "greedy": g} for s, f, g in runs]}

    cells = {
        cell_spec(4, "bypass"): cell((0, 0.5, 0.9), (1, 0.4, 0.8)),
        cell_spec(4, "decoupled"): cell((0, 0.6, 0.85), (1, 0.5, 0.75)),
        cell_spec(4, "tseq_is"): cell((1, 0.7, 0.9), (0, 0.6, 0.95), (2, 0.9, 0.9)),  # seed 2: unpaired
        cell_spec(8, "tis"): cell((0, 0.1, 0.1), (1, 0.2, 0.2)),  # no K = 8 reference: unpaired
        cell_spec(4, "bypass", ["algo.epochs=2"]): cell((0, 0.0, 0.0), (1, 0.0, 0.0)),
    }
    add_paired_differences(cells)
    t = cells[cell_spec(4, "tseq_is")]
    assert t["vs_bypass"]["n"] == 2 and abs(t["vs_bypass"]["mean"] - (0.1 + 0.3) / 2) < 1e-12
    assert abs(t["greedy_vs_bypass"]["mean"] - (0.05 + 0.1) / 2) < 1e-12
    assert abs(t["vs_decoupled"]["mean"] - (0.0 + 0.2) / 2) < 1e-12
    assert abs(t["greedy_vs_decoupled"]["mean"] - (0.1 + 0.15) / 2) < 1e-12
    d = cells[cell_spec(4, "decoupled")]
    assert abs(d["vs_bypass"]["mean"] - 0.1) < 1e-12 and "vs_decoupled" not in d
    assert (
        "vs_decoupled" not in cells[cell_spec(4, "bypass")]
        and "vs_bypass" not in cells[cell_spec(4, "bypass")]
    )
    assert "vs_bypass" not in cells[cell_spec(8, "tis")]
    assert "vs_bypass" not in cells[cell_spec(4, "bypass", ["algo.epochs=2"])]


def test_the_markdown_table_has_one_row_per_lag_and_counts_collapses(tmp_path):
    from lab.drift_cells import cell_spec
    from lab.drift_report import markdown
    from lab.drift_table import table
    from lab.modes_run import run_dir_name

    out = tmp_path / "grid"
    (out / "initial_eval").mkdir(parents=True)
    (out / "initial_eval" / "x.json").write_text(json.dumps({"metrics": {"eval/sampled_reward_mean": 0.4}}))
    specs = [cell_spec(0, "none"), cell_spec(4, "tis")]
    finals = {specs[0]: [0.6, 0.7], specs[1]: [0.3, 0.5]}
    for spec in specs:
        for seed, final in enumerate(finals[spec]):
            write_run(out / run_dir_name(spec) / f"seed{seed}", rows_of([0.5] * 20), final)
    write_run(out / run_dir_name(specs[1]) / "seed2", rows_of([0.5] * 12), None)  # stopped early
    result = table(out, specs, [0, 1, 2], 0.15, {"threshold": 4.0})
    md = markdown(result["cells"], 0.4).splitlines()
    assert md[2] == "| | bypass | tis |"
    assert md[4].startswith("| K = 0 | 0.650 +- 0.071 (2) |") and md[4].endswith("|  |")
    assert "| K = 4 |  | 0.400 +- 0.141 (2), 1 stopped, **2 collapsed**" in md[5]


def test_resume_skips_finished_seeds_and_clears_a_killed_one(tmp_path):
    from lab.drift_cells import cell_spec
    from lab.drift_store import pending_seeds
    from lab.modes_run import run_dir_name

    spec = cell_spec(2, "tis")
    finished = write_run(tmp_path / run_dir_name(spec) / "seed0", rows_of([0.5] * 5), 0.6)
    (finished / "heldout_curve.json").write_text("{}")
    killed = write_run(tmp_path / run_dir_name(spec) / "seed1", rows_of([0.5] * 5), None)
    assert pending_seeds(tmp_path, spec, [0, 1, 2]) == [1, 2]
    assert finished.exists() and not killed.exists()


def drifting_rows() -> list[dict[str, str]]:
    """40 trained steps at lag 1 with every signal the detector and the diagnostics read, the
    behaviour KL and weights blowing up from step 20 (so the detector alarms), the reward
    falling from step 25 (so the collapse is dated)."""
    rows = rows_of([0.5] * 25 + [0.0] * 15)
    for i, r in enumerate(rows):
        bad = i >= 20
        r.update(
            {
                "train/kl_behavior": str(0.5 if bad else 0.01 + 0.001 * (i % 3)),
                "train/clip_frac": str(0.3 if bad else 0.01),
                "train/grad_norm": str(50.0 if bad else 1.0 + 0.1 * (i % 2)),
                "is/ess_frac": str(0.05 if bad else 0.95),
                "is/zeroed_frac": "0.01",
                "is/weight_max": str(100.0 if bad else 2.0),
                "mismatch/k3": str(0.1 if bad else 1e-4),
                "rollout/staleness_max": "1",
                "perf/samples_per_s": "3.5",
                "perf/other": "7",
            }
        )
    return [*rows, {"step": "40", "perf/other": "8"}]  # a row with nothing kept


def test_a_stored_run_reads_as_its_directory_and_resume_skips_it(tmp_path):
    """The committed store (lab/run_store.py) stands in for a run directory a new
    checkout no longer has: the same outcome (alarm, collapse, diagnostics), the same table
    cell, and --resume skips it."""
    from lab import run_store
    from lab.drift_cells import cell_spec
    from lab.drift_store import archive, pending_seeds
    from lab.drift_table import table
    from lab.modes_run import run_dir_name

    out, store = tmp_path / "grid", tmp_path / "store.jsonl"
    spec = cell_spec(1, "tis")
    start = {"eval/sampled_reward_mean": 0.4}
    (out / "initial_eval").mkdir(parents=True)
    (out / "initial_eval" / "x.json").write_text(json.dumps({"metrics": start}))
    for seed, final in [(0, 0.2), (1, 0.6)]:
        run = write_run(out / run_dir_name(spec) / f"seed{seed}", drifting_rows(), final)
        (run / "heldout_curve.json").write_text("{}")
        summary = json.loads((run / "eval_summary.json").read_text())
        (run / "eval_summary.json").write_text(json.dumps({**summary, "first": start}))
    write_run(out / run_dir_name(spec) / "seed2", rows_of([0.5] * 5), None)  # crashed
    write_run(out / run_dir_name(spec) / "seed3", rows_of([0.5] * 12), None)  # diverged
    results = [
        {"seed": 0},
        {"seed": 1},
        {"seed": 2, "failed": True, "diverged": False, "error": "EngineDeadError"},
        {"seed": 3, "failed": True, "diverged": True, "error": "NonFiniteLossError: 3 consecutive"},
    ]
    stored: dict = {}
    setup = {"overrides": ["module.optimizer.lr=3e-3"], "eval_every": 60, "commit": "abc"}
    archive(out, spec, results, store, stored, setup)
    archive(out, spec, results, store, stored, setup)  # idempotent: nothing stored twice
    loaded = run_store.load(store)
    assert sorted(loaded) == [(spec, 0), (spec, 1), (spec, 3)]  # the crash is left to rerun
    assert len(store.read_text().splitlines()) == 3
    assert loaded[(spec, 3)]["last"] is None and loaded[(spec, 3)]["start_sampled"] is None
    assert loaded[(spec, 0)]["start_sampled"] == 0.4 and loaded[(spec, 0)]["overrides"] == setup["overrides"]
    kept = loaded[(spec, 0)]["rows"]
    assert len(kept) == 41 and kept[-1] == {"step": "40"} and "perf/other" not in kept[0]
    seeds = [0, 1, 2, 3]
    from_dirs = table(out, [spec], seeds, 0.15, {"threshold": 4.0})["cells"][spec]
    # with a store, a directory with no curve that is not stored is unfinished: left out
    both = table(out, [spec], seeds, 0.15, {"threshold": 4.0}, loaded)["cells"][spec]
    assert [r["seed"] for r in both["runs"]] == [0, 1, 3] and both["missing_seeds"] == [2]
    shutil.rmtree(out)  # a fresh checkout: only the store
    from_store = table(out, [spec], seeds, 0.15, {"threshold": 4.0}, loaded)["cells"][spec]
    same = [r for r in from_dirs["runs"] if r["seed"] != 2]
    assert json.dumps(from_store["runs"]) == json.dumps(same)
    run0 = from_store["runs"][0]
    assert run0["first_alarm"] is not None and run0["collapse_step"] is not None and run0["lead_steps"] > 0
    assert all(math.isfinite(v) for v in run0["diagnostics"].values())
    assert from_store["runs"][2]["collapse_rule"] == "stopped"
    assert pending_seeds(out, spec, seeds, loaded) == [2]


def test_a_line_cut_short_is_skipped_and_the_next_record_is_whole(tmp_path, capsys):
    from lab import run_store

    store = tmp_path / "store.jsonl"
    run_store.append(store, {"spec": "a", "seed": 0, "rows": []})
    with open(store, "a") as f:
        f.write('{"spec": "a", "seed": 1, "ro')  # a writer killed mid-line
    run_store.append(store, {"spec": "a", "seed": 2, "rows": []})
    assert sorted(run_store.load(store)) == [("a", 0), ("a", 2)]
    assert "line 2 is cut short" in capsys.readouterr().err


def test_a_store_of_another_setup_is_refused(tmp_path):
    from lab.drift_cells import cell_spec
    from lab.drift_store import check_setup

    spec = cell_spec(1, "tis")
    stored = {(spec, 0): {"overrides": ["module.optimizer.lr=2e-3"], "eval_every": 60}}
    ok = {"overrides": ["module.optimizer.lr=2e-3"], "eval_every": 60, "commit": "x"}
    check_setup(stored, [spec], ok)
    check_setup(stored, [cell_spec(2, "tis")], {**ok, "eval_every": 20})  # other cells: not ours
    with pytest.raises(SystemExit, match="lr=2e-3"):
        check_setup(stored, [spec], {**ok, "overrides": ["module.optimizer.lr=3e-3"]})


def test_runs_from_different_warm_starts_are_refused(tmp_path):
    from lab.drift_store import start_reward

    (tmp_path / "initial_eval").mkdir()
    (tmp_path / "initial_eval" / "x.json").write_text(
        json.dumps({"metrics": {"eval/sampled_reward_mean": 0.4}})
    )
    # a run that stopped before its evaluation has no start: ignored, not a second warm start
    assert (
        start_reward(tmp_path, {("a", 0): {"start_sampled": 0.4}, ("a", 1): {"start_sampled": None}}) == 0.4
    )
    with pytest.raises(SystemExit, match="different warm starts"):
        start_reward(tmp_path, {("a", 0): {"start_sampled": 0.387}})
    assert start_reward(tmp_path / "none", {("a", 0): {"start_sampled": 0.387}}) == 0.387
    assert math.isnan(start_reward(tmp_path / "none", {}))


def test_another_build_of_the_warm_start_is_read_from_its_own_store_and_paired_within_it(tmp_path):
    """A warm start rebuilt on another machine evaluates a little differently. One store holds
    one build (mixing is refused); another build's store is read beside it: its runs join the
    cells, are judged against their own start, and pair only with runs of their own build. The
    store keeps the build's weight hash."""
    from lab import run_store
    from lab.drift_cells import cell_spec
    from lab.drift_report import markdown
    from lab.drift_table import table

    k0, k2 = cell_spec(0, "bypass"), cell_spec(2, "bypass")
    run = write_run(tmp_path / "runs" / "seed0", rows_of([0.5] * 20), 0.41)
    (run / "eval_summary.json").write_text(
        json.dumps({"first": {"eval/sampled_reward_mean": 0.40}, "last": {"eval/sampled_reward_mean": 0.41}})
    )
    (run / "heldout_curve.json").write_text(json.dumps({"initial_weights": "abc123"}))
    rec = run_store.record(run, k0, 0, {"overrides": [], "eval_every": 20, "commit": "x"})
    assert rec["warm_start"] == "abc123" and rec["start_sampled"] == 0.40

    def at(spec, seed, start, final, greedy=0.9):
        return {
            **rec,
            "spec": spec,
            "seed": seed,
            "start_sampled": start,
            "last": {"eval/sampled_reward_mean": final, "eval/reward_mean": greedy},
        }

    # build A (read beside): K = 0 and K = 2, seeds 0-1; build B (the store written now): K = 2
    # seeds 0-1, no K = 0 of its own yet, and its start 0.42
    build_a = {
        (k0, 0): at(k0, 0, 0.40, 0.60),
        (k0, 1): at(k0, 1, 0.40, 0.70),
        (k2, 0): at(k2, 0, 0.40, 0.50),
        (k2, 1): at(k2, 1, 0.40, 0.65),
    }
    build_b = {(k2, 0): at(k2, 0, 0.42, 0.41), (k2, 1): at(k2, 1, 0.42, 0.90)}
    out = tmp_path / "fresh"  # a new checkout: the stores only
    with pytest.raises(SystemExit, match="--with-store"):
        table(out, [k0, k2], [0, 1], 0.15, {}, {**build_a, (k2, 5): at(k2, 5, 0.42, 0.5)})
    cells = table(out, [k0, k2], [0, 1], 0.15, {}, build_b, [build_a])["cells"]
    runs = cells[k2]["runs"]
    assert [(r["seed"], r["build"]) for r in runs] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [r["collapsed"] for r in runs] == [True, False, False, False]  # 0.41 < its own 0.42
    assert cells[k2]["other_build"] == 2 and cells[k0]["other_build"] == 2
    # paired only within build A (diffs -0.10, -0.05); build B has no K = 0 to pair with
    assert cells[k2]["vs_k0"]["n"] == 2 and abs(cells[k2]["vs_k0"]["mean"] + 0.075) < 1e-12
    assert abs(cells[k2]["final_sampled_mean"] - (0.41 + 0.90 + 0.50 + 0.65) / 4) < 1e-12
    assert "(2 of another build)" in markdown(cells, 0.42)
    with pytest.raises(SystemExit, match="count twice"):  # one build read twice
        table(out, [k0, k2], [0, 1], 0.15, {}, build_b, [build_a, dict(build_a)])
    with pytest.raises(SystemExit, match="no run with a warm-start evaluation"):
        table(out, [k0, k2], [0, 1], 0.15, {}, build_b, [{(k0, 0): {**rec, "start_sampled": None}}])


def test_a_run_of_another_build_is_not_appended_to_the_store(tmp_path):
    """A machine whose rebuilt warm start differs (its hash, or for older records its held-out
    start) cannot add its runs to a store of another build: the store stays one build."""
    from lab.drift_cells import cell_spec
    from lab.drift_store import archive, other_build

    spec = cell_spec(2, "tis")
    run = write_run(tmp_path / "out" / "x", rows_of([0.5] * 5), 0.6)
    stored_a = {(spec, 0): {"start_sampled": 0.3867, "warm_start": None}}
    assert "evaluates at 0.385900" in other_build({"start_sampled": 0.3859, "warm_start": "b"}, stored_a)
    assert other_build({"start_sampled": 0.3867, "warm_start": "b"}, stored_a) is None
    stored_b = {(spec, 0): {"start_sampled": 0.3859, "warm_start": "bbb"}}
    assert "weights" in other_build({"start_sampled": 0.3859, "warm_start": "ccc"}, stored_b)
    assert other_build({"start_sampled": None, "warm_start": None}, stored_b) is None  # a diverged run
    # archive refuses, and writes nothing
    from lab.modes_run import run_dir_name

    run_dir = tmp_path / "out" / run_dir_name(spec) / "seed1"
    shutil.copytree(run, run_dir)
    (run_dir / "eval_summary.json").write_text(
        json.dumps({"first": {"eval/sampled_reward_mean": 0.3859}, "last": {"eval/sampled_reward_mean": 0.6}})
    )
    (run_dir / "heldout_curve.json").write_text(json.dumps({"initial_weights": "ccc"}))
    store = tmp_path / "store.jsonl"
    with pytest.raises(SystemExit, match="its own store"):
        archive(
            tmp_path / "out", spec, [{"seed": 1}], store, dict(stored_b), {"overrides": [], "eval_every": 20}
        )
    assert not store.exists()


def test_a_run_another_worker_holds_is_left_to_it(tmp_path):
    """Two workers on one cell: the second skips the seed the first is running (one directory
    per run), and takes it once the first lets go."""
    import fcntl

    from lab.drift_cells import cell_spec
    from lab.drift_store import run_lock
    from lab.modes_run import run_dir_name

    spec = cell_spec(1, "ds_seq_mask")
    with run_lock(tmp_path, spec, 2) as first:
        assert first
        with run_lock(tmp_path, spec, 2) as second:  # a second open file: as another process
            assert not second
        with run_lock(tmp_path, spec, 1) as other_seed:
            assert other_seed
    with run_lock(tmp_path, spec, 2) as again:
        assert again
    with open(tmp_path / run_dir_name(spec) / "seed2.lock") as f:  # released on exit
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_sweep_leaves_a_run_another_worker_is_finishing(tmp_path):
    """``--analyze`` with a store sweeps in finished runs the store lacks. A run whose worker
    still holds its lock, or that has its held-out curve but not yet the summary written after
    it, is not stored (it once was: a record with no evaluation, read as a stopped run)."""
    import fcntl

    from lab import run_store
    from lab.drift_cells import cell_spec
    from lab.drift_store import sweep
    from lab.modes_run import run_dir_name

    out, store = tmp_path / "grid", tmp_path / "store.jsonl"
    spec = cell_spec(0, "tis")
    setup = {"overrides": [], "eval_every": 60, "commit": "abc"}
    for seed in (0, 1):
        run = write_run(out / run_dir_name(spec) / f"seed{seed}", rows_of([0.5] * 5), 0.6)
        (run / "heldout_curve.json").write_text("{}")
    half = write_run(out / run_dir_name(spec) / "seed2", rows_of([0.5] * 5), None)
    (half / "heldout_curve.json").write_text("{}")  # its summary is not written yet
    with open(out / run_dir_name(spec) / "seed1.lock", "w") as held:  # a worker finishing seed 1
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        stored: dict = {}
        sweep(out, [spec], [0, 1, 2], store, stored, setup)
    assert sorted(run_store.load(store)) == [(spec, 0)]
    sweep(out, [spec], [0, 1, 2], store, stored, setup)  # released: now it is swept
    loaded = run_store.load(store)
    assert sorted(loaded) == [(spec, 0), (spec, 1)] and loaded[(spec, 1)]["last"] is not None
