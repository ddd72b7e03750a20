"""The drift grid's comparisons pooled over lags with the seed as the unit (``lab.drift_pooled``),
on hand-computed cells (no engine, no store)."""

from __future__ import annotations

import pytest

from lab.drift_cells import cell_spec


def cells_of(table: dict[tuple[int, str], tuple[float, ...]]) -> dict[str, dict]:
    """(lag, arm) -> finals of seeds 0, 1, 2 (greedy = sampled here), as ``table`` builds cells."""
    return {
        cell_spec(k, arm): {
            "runs": [{"seed": s, "build": 0, "final_sampled": f, "greedy": f} for s, f in enumerate(finals)]
        }
        for (k, arm), finals in table.items()
    }


CELLS = cells_of(
    {
        (0, "bypass"): (0.60, 0.50, 0.70),
        (2, "bypass"): (0.50, 0.45, 0.55),  # minus K = 0: -0.10, -0.05, -0.15
        (4, "bypass"): (0.40, 0.45, 0.65),  # minus K = 0: -0.20, -0.05, -0.05
        (0, "decoupled"): (0.60, 0.50, 0.70),
        (2, "decoupled"): (0.55, 0.50, 0.60),  # minus bypass's K = 0: -0.05, 0.00, -0.10
    }
)


def test_pooling_over_lags_averages_each_seed_first():
    """bypass, K = 2 and 4 against K = 0: seed means -0.15, -0.05, -0.10, so -0.10 with
    half-width 4.303 * 0.05 / sqrt(3) = 0.124217 (holds 0). The six pairs as independent values
    would give -0.10 +- 2.571 * 0.063246 / sqrt(6) = 0.066383 (excludes 0): the per-seed
    interval must be the wide one."""
    from lab.drift_pooled import pool

    p = pool(CELLS, [2, 4], "k0")["bypass"]
    assert p["n"] == 3 and p["n_pairs"] == 6 and p["mean"] == pytest.approx(-0.10)
    assert p["ci"] == pytest.approx([-0.224217, 0.024217], abs=1e-5) and p["inside_noise"]
    only4 = pool(CELLS, [4], "k0")["bypass"]  # the lag filter: K = 4's three pairs alone
    assert only4["n_pairs"] == 3 and only4["mean"] == pytest.approx(-0.10)


def test_pooled_references_bypass_k0_and_the_same_k_and_the_markdown_counts():
    """``k0:bypass`` pairs every arm with bypass's K = 0 run of the seed; an arm's name, with
    that arm at the same K; the Markdown names the pairs behind each entry."""
    from lab.drift_pooled import markdown, pool, pooled

    d = pool(CELLS, [2], "k0:bypass")["decoupled"]
    assert d["mean"] == pytest.approx(-0.05) and d["n"] == 3
    same_k = pool(CELLS, [2], "bypass")["decoupled"]  # +0.05, +0.05, +0.05: no spread
    assert same_k["mean"] == pytest.approx(0.05) and same_k["ci"] == pytest.approx([0.05, 0.05])
    assert "bypass" not in pool(CELLS, [2], "bypass")  # an arm is not its own reference
    text = markdown(pooled(CELLS, [2, 4]))
    assert "Pooled over K = 2 / 4" in text and "n = 3 seeds" in text
    assert "| bypass | *-0.100 [-0.224, +0.024]* (6 pairs) |" in text


def test_a_lag_with_runs_of_two_builds_counts_once_when_pooling_over_lags():
    """bypass, K = 2 (build 0 only: -0.10, -0.05, -0.15 against K = 0) and K = 8 (build 0:
    -0.20, 0.00, -0.10; build 1: -0.30, -0.10, -0.20). Each seed's K = 8 pairs are averaged
    first (-0.25, -0.05, -0.15), then its two lags: seed means -0.175, -0.05, -0.15, mean -0.125,
    sd 0.066144, half-width 4.303 * 0.066144 / sqrt(3) = 0.164324. Averaging a seed's three
    pairs instead weights K = 8 twice (-0.2, -0.05, -0.15: mean -0.1333)."""
    from lab.drift_pooled import pool

    def runs(build: int, finals: tuple[float, ...]) -> list[dict]:
        return [{"seed": s, "build": build, "final_sampled": f, "greedy": f} for s, f in enumerate(finals)]

    cells = {
        cell_spec(0, "bypass"): {"runs": runs(0, (0.6, 0.5, 0.7)) + runs(1, (0.6, 0.5, 0.7))},
        cell_spec(2, "bypass"): {"runs": runs(0, (0.5, 0.45, 0.55))},
        cell_spec(8, "bypass"): {"runs": runs(0, (0.4, 0.5, 0.6)) + runs(1, (0.3, 0.4, 0.5))},
    }
    p = pool(cells, [2, 8], "k0")["bypass"]
    assert p["n"] == 3 and p["n_pairs"] == 9 and p["mean"] == pytest.approx(-0.125)
    assert p["ci"] == pytest.approx([-0.289324, 0.039324], abs=1e-5)
    only8 = pool(cells, [8], "k0")["bypass"]  # one lag: the two builds averaged within seed
    assert only8["mean"] == pytest.approx(-0.15) and only8["n_pairs"] == 6


def test_no_lagged_pair_prints_no_pooled_table_and_one_arm_no_arm_table():
    """A grid all at K = 0 (``--mismatch``) has no lag to pool and no pooled table; one arm has
    no arm-minus-arm table (no column); one seed gives the mean without an interval, 'n = 1
    seed'; a row with other overrides joins the arm table, named in its caption."""
    from lab.drift_pooled import entry, lags_to_pool, markdown, pooled

    k0_only = [cell_spec(0, a, ["engine.dtype=bfloat16"]) for a in ("bypass", "tis")]
    assert lags_to_pool(k0_only) == [] and lags_to_pool(k0_only, [1, 2]) == []
    assert lags_to_pool([cell_spec(k, "tis") for k in (0, 2, 8)], [1, 2, 4, 8]) == [2, 8]
    assert markdown(pooled(cells_of({(0, "bypass"): (0.5, 0.6)}), [])) == ""
    one_arm = cells_of({(0, "bypass"): (0.6,), (2, "bypass"): (0.5,)})
    text = markdown(pooled(one_arm, [2]))
    assert "n = 1 seed " in text and "| bypass | -0.100 (1 pair) |" in text
    assert "Arm (row)" not in text and "| |  |" not in text
    extra = {**CELLS, **cells_of({(k, "tis"): (0.6, 0.5, 0.7) for k in (0, 2)})}
    for spec in [cell_spec(k, a, ["algo.epochs=2"]) for k in (0, 2) for a in ("bypass", "tis")]:
        extra[spec] = {
            "runs": [{"seed": s, "build": 0, "final_sampled": 0.5, "greedy": 0.5} for s in range(3)]
        }
    text = markdown(pooled(extra, [2]))
    assert "rows with other overrides (bypass algo.epochs=2, tis algo.epochs=2)" in text
    assert "\n| tis algo.epochs=2 | *+0.000 [+0.000, +0.000]* (3 pairs) / *+0.000 [+0.000, +0.000]* |" in text
    p = {"mean": -0.014, "ci": [-0.047, 0.019], "inside_noise": True, "n": 3, "n_pairs": 9}
    assert entry({**p, "reference": "decoupled", "reference_n": 3}, 3) == (
        "*-0.014 [-0.047, +0.019]* (9 pairs, 3 vs plain decoupled's K = 0)"
    )
    assert entry({**p, "n": 2}, 3) == "*-0.014 [-0.047, +0.019]* (2 seeds, 9 pairs)"
    assert entry({**p, "reference": "decoupled", "reference_n": 9}, 3).endswith(
        "(9 pairs, all vs plain decoupled's K = 0)"
    )
