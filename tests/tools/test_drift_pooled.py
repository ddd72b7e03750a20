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
