"""The registered 10-seed endpoints of ``preregistration.md`` (P1-P3, S1, S3, S5), from the stores.

    PYTHONPATH=. python lab/results/bypass2/ten_seeds.py     # prints JSON

Seed the unit: an arm's runs of one seed (T has two on seeds 0-4) are averaged first, then the
per-seed differences get a 95 % t interval (``lab.bench_metrics.mean_ci``).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from lab.bench_metrics import fall_from_peak, mean_ci

HERE = Path(__file__).parent
B = "async_grpo:algo.loss.anchor=bypass,algo/correction=none"
ARMS = {  # arm -> (store, recipe spec) of each of its runs
    "sync": [("ideas", "sync_grpo"), ("ideas2", "sync_grpo")],
    "B": [("bypass1", B), ("bypass2", B)],
    "T": [
        ("ideas", "async_grpo:algo/correction=tseq_is"),
        ("ideas2", "async_grpo"),
        ("bypass2", "async_grpo"),
    ],
}
LEVELS = ("mean", "level0", "level1", "level2")


def records(arm: str) -> list[dict]:
    """Every stored run of ``arm``."""
    out = []
    for store, spec in ARMS[arm]:
        for line in (HERE.parent / store / "runs.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec["recipe"] == spec:
                out.append(rec)
    return out


def per_seed(arm: str, value) -> dict[int, float]:
    """seed -> the mean of ``value(record)`` over the arm's runs of that seed."""
    out = defaultdict(list)
    for rec in records(arm):
        out[int(rec["seed"])].append(value(rec))
    return {s: statistics.fmean(v) for s, v in out.items()}


def minus(a: str, b: str, value) -> dict:
    x, y = per_seed(a, value), per_seed(b, value)
    seeds = sorted(set(x) & set(y))
    return {**mean_ci([x[s] - y[s] for s in seeds]), "seeds": seeds}


def final(key: str):
    return lambda rec: rec["curve_last"][key]


def fall(rec: dict) -> float:
    return fall_from_peak([p["sampled"] for p in rec["curve"]])


def main() -> None:
    out: dict = {"runs_per_seed": {a: dict(sorted(_count(a).items())) for a in ARMS}}
    for level in LEVELS:
        for kind, prefix in (("sampled", "eval/sampled_reward_"), ("greedy", "eval/reward_")):
            key = prefix + level
            out[f"B-sync {kind}/{level}"] = minus("B", "sync", final(key))
            out[f"T-sync {kind}/{level}"] = minus("T", "sync", final(key))
            out[f"B-T {kind}/{level}"] = minus("B", "T", final(key))
    out["B-sync fall/sampled"] = minus("B", "sync", fall)
    print(json.dumps(out, indent=1))


def _count(arm: str) -> dict[int, int]:
    n: dict[int, int] = defaultdict(int)
    for rec in records(arm):
        n[int(rec["seed"])] += 1
    return n


if __name__ == "__main__":
    main()
