"""lab.final_eval_table: the last in-run evaluation per arm, paired per seed, from stored records."""

from __future__ import annotations

import json

import pytest

from lab.final_eval_table import markdown, read, table


def record(spec: str, seed: int, sampled: float, greedy: float, dropped: float) -> dict:
    final = {"eval/sampled_reward_mean": sampled, "eval/reward_mean": greedy}
    final |= {f"eval/sampled_reward_level{i}": sampled + 0.01 * i for i in range(3)}
    final |= {f"eval/reward_level{i}": greedy for i in range(3)}
    figures = {"train_wall_s": 100.0, "samples_per_s": 50.0, "staleness_mean": 1.0, "staleness_max": 2}
    return {"recipe": spec, "seed": seed, "dropped_groups": dropped, **figures, "final_eval": final,
            "counters": {"rollout/dropped": dropped}}  # fmt: skip


def test_paired_per_seed_from_the_stored_records(tmp_path):
    log = tmp_path / "runs.jsonl"
    rows = [record("ref", s, 0.5 + 0.1 * s, 1.0, 0) for s in range(3)]
    rows += [record("arm", s, 0.5 + 0.1 * s + d, 0.9, 7) for s, d in zip(range(3), (0.01, 0.03, 0.05))]
    log.write_text("not json\n" + "".join(json.dumps(r) + "\n" for r in rows))
    t = table(read(log, None), "ref")
    paired = t["arm"]["eval/sampled_reward_mean minus reference"]
    # differences 0.01, 0.03, 0.05: mean 0.03, sd 0.02, t(0.975, 2) = 4.303
    assert paired["mean"] == pytest.approx(0.03) and paired["n"] == 3
    assert paired["hi"] - paired["mean"] == pytest.approx(4.303 * 0.02 / 3**0.5, rel=1e-3)
    assert t["arm"]["eval/reward_mean minus reference"]["mean"] == pytest.approx(-0.1)
    assert t["arm"]["eval/sampled_reward_level2 minus reference"]["mean"] == pytest.approx(0.03)
    assert t["arm"]["dropped_groups"]["mean"] == 7 and "minus reference" not in str(t["ref"].keys())
    assert "+0.030 [" in markdown(t, "ref")
