"""``tools.bound``'s best schedule at two rates per side (alone, and while both run): hand
values and a brute-force check."""

from __future__ import annotations

import itertools

import pytest

from tools.bound import best_schedule_rate


def brute_force(g: float, t: float, gc: float, tc: float, n: int = 400) -> float:
    """max over schedules (overlap f, generation alone a, training alone b; f + a + b = 1)."""
    best = 0.0
    for i, j in itertools.product(range(n + 1), repeat=2):
        a, b = i / n, j / n
        if a + b <= 1:
            f = 1 - a - b
            best = max(best, min(f * gc + a * g, f * tc + b * t))
    return best


def test_no_slowdown_gives_the_solo_bound():
    assert best_schedule_rate(10.0, 20.0, 10.0, 20.0) == pytest.approx(10.0)
    assert best_schedule_rate(30.0, 20.0, 30.0, 20.0) == pytest.approx(20.0)


def test_hand_values():
    # both slowed to 8 of 10: overlapping all the time gives 8, nothing better exists
    assert best_schedule_rate(10.0, 10.0, 8.0, 8.0) == pytest.approx(8.0)
    # generation short while both run (9 < 15): overlap f and generate alone 1 - f,
    # 9 f + 10 (1 - f) = 15 f  ->  f = 10 / 16, X = 150 / 16
    assert best_schedule_rate(10.0, 20.0, 9.0, 15.0) == pytest.approx(150 / 16)
    assert best_schedule_rate(20.0, 10.0, 15.0, 9.0) == pytest.approx(150 / 16)  # symmetric
    # both slowed to 4 of 10: alternating (each alone half the time) trains 5
    assert best_schedule_rate(10.0, 10.0, 4.0, 4.0) == pytest.approx(5.0)


@pytest.mark.parametrize(
    "rates",
    [
        (10, 20, 9, 15),
        (60, 48, 54, 40),
        (100, 10, 30, 9),
        (7, 7, 3, 6),
        (5, 50, 4.5, 20),
        (10, 10, 4, 4),  # overlapping slows both badly: alternating is better
        (10, 20, 3, 5),
        (60, 48, 20, 20),
    ],
)
def test_matches_the_best_schedule_by_brute_force(rates):
    g, t, gc, tc = map(float, rates)
    x = best_schedule_rate(g, t, gc, tc)
    assert x == pytest.approx(brute_force(g, t, gc, tc), rel=5e-3)
    assert max(min(gc, tc), g * t / (g + t)) - 1e-9 <= x <= min(g, t) + 1e-9


def test_noise_above_the_solo_rate_is_clipped_and_bad_rates_refused():
    assert best_schedule_rate(10.0, 20.0, 12.0, 25.0) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="> 0"):
        best_schedule_rate(10.0, 0.0, 5.0, 5.0)
