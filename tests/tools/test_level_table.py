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
