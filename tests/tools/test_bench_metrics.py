"""Time-to-reward on synthetic held-out curves: reached, interpolated, not reached (no engine)."""

from __future__ import annotations

import math

import pytest

from lab.bench_metrics import (
    fall_from_peak,
    interp,
    mean_curve,
    summarize_times,
    target_from_finals,
    time_to_reward,
)

TIMES = [0.0, 10.0, 20.0, 30.0]


def test_reached_exactly_at_an_eval_point():
    assert time_to_reward(TIMES, [0.40, 0.45, 0.50, 0.52], 0.50) == 20.0


def test_interpolated_between_eval_points():
    # 0.44 at 10 s, 0.52 at 20 s: 0.50 is three quarters of the way.
    assert time_to_reward(TIMES, [0.40, 0.44, 0.52, 0.53], 0.50) == pytest.approx(17.5)


def test_without_interpolation_first_point_at_or_above():
    assert time_to_reward(TIMES, [0.40, 0.44, 0.52, 0.53], 0.50, interpolate=False) == 20.0


def test_not_reached_is_none():
    assert time_to_reward(TIMES, [0.40, 0.44, 0.47, 0.49], 0.50) is None


def test_first_crossing_counts_even_if_the_curve_drops_again():
    assert time_to_reward(TIMES, [0.40, 0.51, 0.45, 0.49], 0.50) == pytest.approx(10 * 0.10 / 0.11)


def test_already_at_target_at_start():
    assert time_to_reward(TIMES, [0.55, 0.40, 0.45, 0.50], 0.50) == 0.0


def test_nan_points_are_skipped():
    assert time_to_reward(TIMES, [0.40, math.nan, 0.60, 0.61], 0.50) == pytest.approx(10.0)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError):
        time_to_reward([0.0, 1.0], [0.1], 0.5)
    with pytest.raises(ValueError):
        time_to_reward([0.0, 2.0, 1.0], [0.1, 0.2, 0.3], 0.5)


def test_target_is_mean_of_reference_finals():
    assert target_from_finals([0.50, 0.52, math.nan, 0.54]) == pytest.approx(0.52)
    with pytest.raises(ValueError):
        target_from_finals([math.nan])


def test_summary_counts_seeds_that_never_reach():
    s = summarize_times([10.0, None, 20.0])
    assert s["mean"] == pytest.approx(15.0)
    assert s["std"] == pytest.approx(5.0)
    assert (s["n_reached"], s["n"]) == (2, 3)
    assert s["per_seed"] == [10.0, None, 20.0]
    none = summarize_times([None, None])
    assert none["mean"] is None and none["std"] is None and none["n_reached"] == 0


def test_mean_curve_on_common_grid():
    a = ([0.0, 10.0, 20.0], [0.0, 1.0, 2.0])
    b = ([0.0, 5.0, 10.0], [1.0, 1.0, 1.0])  # shortest run ends at 10 s
    grid, means = mean_curve([a, b], points=3)
    assert grid == [0.0, 5.0, 10.0]
    assert means == pytest.approx([0.5, 0.75, 1.0])
    assert interp(*a, 25.0) == 2.0 and interp(*a, -1.0) == 0.0


def test_mean_curve_held_keeps_ended_runs_at_their_final_reward():
    from lab.bench_metrics import mean_curve_held, target_from_finals, time_to_reward

    a = ([0.0, 10.0], [0.0, 1.0])  # ends at t=10 with 1.0
    b = ([0.0, 20.0], [0.0, 0.5])  # ends at t=20 with 0.5
    grid, mean = mean_curve_held([a, b])
    assert grid == [0.0, 10.0, 20.0]
    assert mean == [0.0, (1.0 + 0.25) / 2, (1.0 + 0.5) / 2]
    # the mean of the final rewards is reached, at the end of the longest run at the latest
    target = target_from_finals([1.0, 0.5])
    assert time_to_reward(grid, mean, target) == 20.0


def test_t95_matches_the_t_table_and_falls_back_to_normal():
    from lab.bench_metrics import t95

    assert t95(1) == 12.706 and t95(4) == 2.776 and t95(30) == 2.042
    assert t95(200) == 1.960
    with pytest.raises(ValueError):
        t95(0)


def test_mean_ci_by_hand():
    from lab.bench_metrics import mean_ci

    ci = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    # mean 3, sample std sqrt(2.5), half width 2.776 * sqrt(2.5) / sqrt(5)
    half = 2.776 * math.sqrt(2.5) / math.sqrt(5)
    assert ci["mean"] == 3.0 and ci["std"] == pytest.approx(math.sqrt(2.5))
    assert ci["lo"] == pytest.approx(3.0 - half) and ci["hi"] == pytest.approx(3.0 + half)
    assert ci["n"] == 5 and ci["n_total"] == 5


def test_mean_ci_skips_missing_values_and_counts_them():
    from lab.bench_metrics import mean_ci

    ci = mean_ci([None, 2.0, float("nan"), 4.0])
    assert ci["mean"] == 3.0 and ci["n"] == 2 and ci["n_total"] == 4
    one = mean_ci([None, 7.0])
    assert one["mean"] == 7.0 and one["lo"] is None and one["hi"] is None
    assert mean_ci([None])["mean"] is None


def test_bootstrap_ratio_and_difference():
    from lab.bench_metrics import bootstrap_ci

    a, b = [10.0, 12.0, 11.0, 9.0, 13.0], [20.0, 22.0, 21.0, 19.0, 23.0]
    r = bootstrap_ci(a, b, "ratio", n_boot=4000)
    assert r["value"] == pytest.approx(11.0 / 21.0)
    assert r["lo"] < r["value"] < r["hi"]
    assert 0.4 < r["lo"] and r["hi"] < 0.65  # tight: both groups vary by +-2 around 11 and 21
    d = bootstrap_ci(a, b, "diff", n_boot=4000)
    assert d["value"] == pytest.approx(-10.0) and d["lo"] < -10.0 < d["hi"] < 0
    # identical groups: a difference interval that covers 0
    same = bootstrap_ci(a, a, "diff", n_boot=4000)
    assert same["lo"] < 0 < same["hi"]
    # reproducible from its seed
    assert bootstrap_ci(a, b, "ratio", n_boot=500, seed=3) == bootstrap_ci(a, b, "ratio", n_boot=500, seed=3)


def test_bootstrap_empty_group_or_zero_denominator_is_none():
    from lab.bench_metrics import bootstrap_ci

    assert bootstrap_ci([], [1.0])["value"] is None
    assert bootstrap_ci([1.0], [0.0, 0.0])["value"] is None
    with pytest.raises(ValueError):
        bootstrap_ci([1.0], [1.0], "product")


def test_reward_at_interpolates_and_holds_the_final_policy():
    from lab.bench_metrics import reward_at

    assert reward_at(TIMES, [0.40, 0.44, 0.52, 0.53], 15.0) == pytest.approx(0.48)
    assert reward_at(TIMES, [0.40, 0.44, 0.52, 0.53], 100.0) == 0.53  # the run ended at 30 s
    assert reward_at(TIMES, [0.40, 0.44, 0.52, 0.53], 0.0) == 0.40
    assert math.isnan(reward_at([], [], 1.0))


def test_welch_difference_by_hand():
    from lab.bench_metrics import t95, welch_diff_ci

    a, b = [1.0, 2.0, 3.0], [2.0, 4.0, 6.0, 8.0]
    va, vb = 1.0 / 3, (20.0 / 3) / 4  # sample variances 1 and 20/3 over n
    df = int((va + vb) ** 2 / (va**2 / 2 + vb**2 / 3))
    ci = welch_diff_ci(a, b)
    assert ci["df"] == df and ci["value"] == pytest.approx(-3.0)
    assert ci["hi"] - ci["value"] == pytest.approx(t95(df) * math.sqrt(va + vb))
    assert welch_diff_ci([1.0], b)["value"] is None


def test_ratio_interval_is_wider_than_the_plug_in_bootstrap_with_few_seeds():
    from lab.bench_metrics import bootstrap_ci, ratio_ci

    a, b = [10.0, 12.0, 11.0, 9.0, 13.0], [20.0, 22.0, 21.0, 19.0, 23.0]
    r = ratio_ci(a, b)
    assert r["value"] == pytest.approx(11.0 / 21.0) and r["lo"] < r["value"] < r["hi"]
    boot = bootstrap_ci(a, b, "ratio", n_boot=4000)
    assert r["hi"] - r["lo"] > boot["hi"] - boot["lo"]
    # symmetric on the log scale
    assert math.log(r["hi"] / r["value"]) == pytest.approx(math.log(r["value"] / r["lo"]))
    assert ratio_ci([1.0, 2.0], [0.0, 0.0])["value"] is None


def test_modes_table_renders_a_row_per_recipe_with_intervals():
    from lab.modes_table import rows

    def stat(m, lo=None, hi=None, std=0.0):
        return {"mean": m, "lo": lo, "hi": hi, "std": std, "n": 5, "n_total": 5}

    recipe = {
        "samples_per_s": {"mean": 50.0},
        "staleness_mean": {"mean": 0.85},
        "dropped_groups": {"mean": 323.0},
        "power": {
            "final": {
                "eval/sampled_reward_mean": stat(0.8, 0.79, 0.81),
                "eval/sampled_reward_level0": stat(0.97),
                "eval/sampled_reward_level2": stat(0.05),
                "eval/reward_mean": stat(0.9),
            },
            "final_minus_reference": {"value": 0.05, "lo": 0.026, "hi": 0.074},
            "train_wall_s": stat(151.0, std=12.0),
            "time_to_90pct_gain_s": stat(104.0, 93.0, 114.0),
            "time_ratio_to_reference": {
                "value": 0.48,
                "lo": 0.37,
                "hi": 0.63,
                "bootstrap": {"lo": 0.4, "hi": 0.57},
            },
            "reward_at_equal_wall": {"0.5x_reference_wall": stat(0.747, 0.726, 0.767)},
        },
    }
    one_seed = {**recipe, "power": {**recipe["power"], "train_wall_s": {"mean": 150.0, "std": None}}}
    table = rows(
        {"recipes": {"async_grpo": recipe, "partial_grpo": {**recipe, "power": {}}, "one": one_seed}}
    )
    assert "| 150 |" in table[4]
    assert len(table) == 5 and table[0].count("|") == table[2].count("|")
    assert "0.800 [0.790, 0.810]" in table[2] and "0.48 [0.37, 0.63] (0.40-0.57)" in table[2]
    assert "104 [93, 114] (5/5)" in table[2] and "151 +- 12" in table[2] and "| 0.050 |" in table[2]
    assert table[3].count(" - ") >= 5  # a recipe without a curve: dashes, not a crash


def test_run_dir_names_are_safe_in_hydra_overrides():
    from lab.modes_run import run_dir_name

    name = run_dir_name("async_grpo:rollout.max_staleness=2,algo.loss.anchor=decoupled,algo/correction=tis")
    assert "=" not in name and "," not in name and "/" not in name and name.startswith("async_grpo+")
    deleted = run_dir_name("agent_calculator:rollout=sync,~rollout.max_staleness")
    assert "~" not in deleted and deleted == "agent_calculator+rollout-sync+no.rollout.max_staleness"


def test_per_seed_ci_averages_within_seed_first_where_pooling_would_not():
    """Two runs per seed (e.g. two lags, each minus the same K = 0 run). Seed means 0.2, 0.1,
    0.3: mean 0.2, sd 0.1, half-width 4.303 * 0.1 / sqrt(3) = 0.24844, so the interval holds 0.
    The six runs pooled as independent (sd sqrt(0.1 / 5), t(5) = 2.571) would give
    0.2 +- 0.14844, excluding 0: the per-seed interval must not."""
    from lab.bench_metrics import by_seed, mean_ci, per_seed_ci

    runs = {0: [0.1, 0.3], 1: [0.0, 0.2], 2: [0.4, 0.2]}
    ci = per_seed_ci(runs)
    assert ci["n"] == 3 and ci["n_runs"] == 6 and ci["seed_means"] == pytest.approx({0: 0.2, 1: 0.1, 2: 0.3})
    assert ci["mean"] == pytest.approx(0.2) and ci["std"] == pytest.approx(0.1)
    assert ci["lo"] == pytest.approx(0.2 - 0.24844, abs=1e-5) and ci["hi"] == pytest.approx(0.44844, abs=1e-5)
    pooled = mean_ci([v for vs in runs.values() for v in vs])
    assert pooled["lo"] == pytest.approx(0.05156, abs=1e-5) and pooled["hi"] == pytest.approx(
        0.34844, abs=1e-5
    )
    assert ci["lo"] < 0 < pooled["lo"]
    # the same from (seed, value) pairs, in any order; None / NaN skipped, a seed of them dropped
    pairs = [(2, 0.4), (0, 0.1), (1, 0.0), (0, 0.3), (2, 0.2), (1, 0.2), (1, None), (3, math.nan)]
    again = per_seed_ci(by_seed(pairs))
    assert again["n"] == 3 and again["n_total"] == 4 and again["n_runs"] == 6
    assert (again["lo"], again["hi"]) == pytest.approx((ci["lo"], ci["hi"]))
    one = per_seed_ci({0: [0.1, 0.5]})  # one seed: a mean, no interval, however many runs
    assert one["mean"] == pytest.approx(0.3) and one["lo"] is None and one["n"] == 1


def test_paired_per_seed_ci_matches_arms_by_seed_after_averaging_each():
    """a - b by seed: seed 0 (0.5 + 0.7) / 2 - 0.4 = 0.2, seed 1 0.6 - (0.5 + 0.3) / 2 = 0.2,
    seed 2 0.9 - 0.6 = 0.3 (seed 3 only in b: left out). Mean 0.23333, sd 0.057735, half-width
    4.303 * 0.057735 / sqrt(3) = 0.143433."""
    from lab.bench_metrics import paired_per_seed_ci

    a = {0: [0.5, 0.7], 1: [0.6], 2: [0.9]}
    b = {0: [0.4], 1: [0.5, 0.3], 2: [0.6], 3: [0.1]}
    d = paired_per_seed_ci(a, b)
    assert d["n"] == 3 and d["n_unmatched"] == 1
    assert d["seed_means"] == pytest.approx({0: 0.2, 1: 0.2, 2: 0.3})
    assert d["mean"] == pytest.approx(0.233333, abs=1e-6)
    assert d["lo"] == pytest.approx(0.089900, abs=1e-5) and d["hi"] == pytest.approx(0.376767, abs=1e-5)
    assert paired_per_seed_ci({0: [1.0]}, {1: [0.0]})["n"] == 0  # no seed in both: nothing


def test_paired_per_seed_ci_counts_runs_of_both_arms_and_seeds_of_either():
    """``n_runs`` counts the finite runs of both arms in the matched seeds (what the seed
    differences average), not one per seed; ``n_total`` the seeds given in either arm. Seeds
    0-2 match (a: 2 + 1 + 1 runs, b: 1 + 2 + 1, a None in b's seed 2 not counted); seed 3 is
    only in b, seed 4 only in a with nothing finite: 5 seeds in all, 1 unmatched with a value."""
    from lab.bench_metrics import paired_per_seed_ci

    a = {0: [0.5, 0.7], 1: [0.6], 2: [0.9], 4: [math.nan]}
    b = {0: [0.4], 1: [0.5, 0.3], 2: [0.6, None], 3: [0.1]}
    d = paired_per_seed_ci(a, b)
    assert (d["n"], d["n_runs"], d["n_total"], d["n_unmatched"]) == (3, 8, 5, 1)
    assert d["mean"] == pytest.approx(0.233333, abs=1e-6)


def test_infinite_values_are_skipped_like_none_and_nan():
    """A run whose value is +-inf (a ratio over zero, a diverged loss) is skipped and not
    counted, in ``mean_ci`` and within a seed; a seed of such values is left out."""
    from lab.bench_metrics import mean_ci, paired_per_seed_ci, per_seed_ci

    ci = per_seed_ci({0: [math.inf, 1.0], 1: [0.0], 2: [1.0], 3: [-math.inf]})
    assert ci["seed_means"] == {0: 1.0, 1: 0.0, 2: 1.0}
    assert (ci["n"], ci["n_runs"], ci["n_total"]) == (3, 3, 4)
    assert ci["mean"] == pytest.approx(2 / 3)
    m = mean_ci([math.inf, 0.2, -math.inf, 0.4, None])
    assert (m["n"], m["n_total"]) == (2, 5) and m["mean"] == pytest.approx(0.3)
    d = paired_per_seed_ci({0: [math.inf, 0.5], 1: [0.3]}, {0: [0.1], 1: [-math.inf]})
    assert d["n"] == 1 and d["n_runs"] == 2 and d["n_unmatched"] == 1 and d["mean"] == pytest.approx(0.4)


def test_the_fall_from_the_peak_is_the_best_point_minus_the_last():
    assert fall_from_peak([0.2, 0.95, 0.93, 0.914]) == pytest.approx(0.036)  # peaked, then fell
    assert fall_from_peak([0.2, 0.5, 0.9]) == 0.0  # still rising: no fall
    assert fall_from_peak([0.2, math.nan, 0.7, 0.6]) == pytest.approx(0.1)  # a missing point skipped
    assert math.isnan(fall_from_peak([0.2, 0.9, math.nan]))  # no final point: no fall to measure
    assert math.isnan(fall_from_peak([]))
