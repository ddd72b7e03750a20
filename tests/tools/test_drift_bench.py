"""How ``lab.drift_grid`` dates a collapse, scores the detector and pairs its cells, on hand-made
metrics.csv (the run store and --resume: ``test_drift_bench_store``)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

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
