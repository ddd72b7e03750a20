"""Time-to-reward on synthetic held-out curves: reached, interpolated, not reached (no engine)."""

from __future__ import annotations

import math

import pytest

from benchmarks.bench_metrics import interp, mean_curve, summarize_times, target_from_finals, time_to_reward

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
    from benchmarks.bench_metrics import mean_curve_held, target_from_finals, time_to_reward

    a = ([0.0, 10.0], [0.0, 1.0])  # ends at t=10 with 1.0
    b = ([0.0, 20.0], [0.0, 0.5])  # ends at t=20 with 0.5
    grid, mean = mean_curve_held([a, b])
    assert grid == [0.0, 10.0, 20.0]
    assert mean == [0.0, (1.0 + 0.25) / 2, (1.0 + 0.5) / 2]
    # the mean of the final rewards is reached, at the end of the longest run at the latest
    target = target_from_finals([1.0, 0.5])
    assert time_to_reward(grid, mean, target) == 20.0
