"""``lab.level_table``: a level is lost only when the paired interval lies wholly below 0."""

from __future__ import annotations

import json
from pathlib import Path

from lab.level_table import compare, markdown, read_runs


def record(recipe: str, seed: int, level2: float, mean: float) -> dict:
    last = {
        "eval/sampled_reward_mean": mean,
        "eval/sampled_reward_level0": 0.9,
        "eval/sampled_reward_level2": level2,
        "eval/reward_mean": 0.95,
        "eval/reward_level0": 1.0,
        "eval/reward_level2": 0.9,
    }
    return {"recipe": recipe, "seed": seed, "curve_last": last}


def test_a_level_below_the_reference_beyond_the_noise_is_lost(tmp_path: Path):
    log = tmp_path / "runs.log"
    lines = ["not a record"]
    for s in range(4):
        lines.append(json.dumps(record("sync_grpo", s, 0.13 + 0.01 * s, 0.75 + 0.01 * s)))
        # level 2 always 0.08 lower; the mean differs by +-0.02 around 0 (noise)
        lines.append(
            json.dumps(record("async_grpo", s, 0.05 + 0.01 * s, 0.75 + 0.01 * s + (0.02 if s % 2 else -0.02)))
        )
    log.write_text("\n".join(lines))
    table = compare(read_runs([log]), "sync_grpo")
    fast = table["async_grpo"]
    assert fast["sampled/level2"]["lost"]
    assert abs(fast["sampled/level2"]["minus_reference"]["mean"] + 0.08) < 1e-9
    assert not fast["sampled/mean"]["lost"] and not fast["sampled/level0"]["lost"]
    assert not any(v["lost"] for k, v in table["sync_grpo"].items() if "/" in k)
    text = markdown(table, "sync_grpo")
    assert "| `async_grpo` | 4 |" in text and "level2 |" in text
    sampled, greedy = text.split("greedy reward per level")
    assert "**-0.080" in sampled  # beyond the noise: bold
    assert [ln for ln in sampled.splitlines() if ln.startswith("| `async_grpo`")][0].endswith("| level2 |")
    assert [ln for ln in greedy.splitlines() if ln.startswith("| `async_grpo`")][0].endswith("| none |")


def test_a_sitting_without_curves_takes_each_runs_last_in_run_evaluation(tmp_path: Path):
    """``lab.modes --eval-every 0``: empty ``curve_last``; ``--runs`` fills it from the run's
    eval_summary.json and the bound counters from its metrics.csv; the filled records alone
    give the same table (``--store``)."""
    from lab.modes_run import run_dir_name

    lines = []
    for spec, shift, dropped in (("ref", 0.0, 0), ("arm", None, 7)):
        for s, d in zip(range(3), (0.01, 0.03, 0.05)):
            sampled = 0.5 + 0.1 * s + (d if shift is None else shift)
            last = {"eval/sampled_reward_mean": sampled, "eval/reward_mean": 1.0 if shift == 0.0 else 0.9}
            last |= {f"eval/sampled_reward_level{i}": sampled + 0.01 * i for i in range(3)}
            last |= {f"eval/reward_level{i}": last["eval/reward_mean"] for i in range(3)}
            run = tmp_path / f"seed{s}" / run_dir_name(spec) / f"seed{s}"
            run.mkdir(parents=True)
            (run / "eval_summary.json").write_text(json.dumps({"last": last}))
            (run / "metrics.csv").write_text(f"rollout/dropped,rollout/staleness_max\n{dropped},2\n")
            lines.append(json.dumps({"recipe": spec, "seed": s, "curve_last": {}}))
    log = tmp_path / "runs.log"
    log.write_text("\n".join(lines))
    runs = read_runs([log], str(tmp_path / "seed{seed}"))
    table = compare(runs, "ref")
    paired = table["arm"]["sampled/mean"]["minus_reference"]
    # differences 0.01, 0.03, 0.05: mean 0.03, sd 0.02, t(0.975, 2) = 4.303
    assert abs(paired["mean"] - 0.03) < 1e-9 and paired["n"] == 3
    assert abs((paired["hi"] - paired["mean"]) - 4.303 * 0.02 / 3**0.5) < 1e-3
    assert abs(table["arm"]["greedy/mean"]["minus_reference"]["mean"] + 0.1) < 1e-9
    assert abs(table["arm"]["sampled/level2"]["minus_reference"]["mean"] - 0.03) < 1e-9
    assert table["arm"]["counters"]["rollout/dropped"]["mean"] == 7
    assert "+0.030 [" in markdown(table, "ref")
    stored = tmp_path / "stored.jsonl"
    stored.write_text("".join(json.dumps(r) + "\n" for seeds in runs.values() for r in seeds.values()))
    assert compare(read_runs([stored]), "ref") == table


def test_a_run_that_peaks_and_falls_more_than_the_reference_shows_a_late_fall():
    """Curves (``lab.modes --eval-every N``): each run's peak minus its final point, paired by
    seed against the reference's; above 0 beyond the noise is a late fall."""
    runs: dict[str, dict[int, dict]] = {"ref": {}, "arm": {}}
    for s in range(4):
        ref = [0.2, 0.8, 0.9, 0.95 - 0.01 * s]  # the reference ends near its peak
        arm = [0.2, 0.85, 0.96, 0.90 - 0.01 * s + 0.005 * (s % 2)]  # peaks at 0.96, then falls
        for spec, vals in (("ref", ref), ("arm", arm)):
            curve = [{"sampled": v, "greedy": 1.0, "step": 10 * i} for i, v in enumerate(vals)]
            last = {"eval/sampled_reward_mean": vals[-1], "eval/reward_mean": 1.0}
            runs[spec][s] = {"recipe": spec, "seed": s, "curve": curve, "curve_last": last}
    table = compare(runs, "ref")
    fall = table["arm"]["fall/sampled"]
    # per seed the arm falls 0.96 - its last (0.060, 0.065, 0.080, 0.085); the reference's last
    # point (0.91-0.95) is its peak, a fall of 0
    expected = [0.96 - (0.90 - 0.01 * s + 0.005 * (s % 2)) for s in range(4)]
    assert abs(fall["minus_reference"]["mean"] - sum(expected) / 4) < 1e-9
    assert fall["late_fall"] and not table["arm"]["fall/greedy"]["late_fall"]
    assert table["ref"]["fall/sampled"]["value"]["mean"] == 0.0
    text = markdown(table, "ref")
    assert "Fall from the curve's peak" in text
    assert [ln for ln in text.splitlines() if ln.startswith("| `arm` | 4 | 0.0")][0].endswith("| sampled |")
    del runs["ref"][0]["curve"]  # a reference run without a curve: no fall row at all
    assert "fall/sampled" not in compare(runs, "ref")["arm"]


def test_a_no_bound_log_is_read_back_without_composing_its_specs(tmp_path: Path):
    """``lab.modes --from-log`` of a ``--no-bound`` sitting: no bound record to match, so a
    spec that no longer composes on today's config (a group since added to a defaults list)
    still reads back."""
    from lab.modes import read_log

    spec = "agent_calculator:rollout=partial,+rollout/staleness=regenerate"  # `+` fails today
    log = tmp_path / "runs.log"
    log.write_text(json.dumps({"recipe": spec, "seed": 0, "sampled_eval_after": 0.9}) + "\nnoise\n")
    bounds, bound_of, runs = read_log(log, [spec])
    assert bounds == {} and bound_of == {} and runs[spec][0]["sampled_eval_after"] == 0.9
