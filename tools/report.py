"""Render a run's dashboard PNG from its metrics.csv.

    make report RUN=outputs/sync_grpo/2026-11-29_12-00-00
    python -m tools.report outputs/async_grpo/<time> [--out dashboard.png]

Panels: reward (train and held-out) vs wall-clock and vs trained samples; staleness histogram
over time; IS weights and ESS; response lengths and the length bias; trainer and engine idle
fractions; weight-sync time; where each optimizer step's time goes (``perf/step_*_s``,
``modules/callbacks/step_timer.py``); the drift score, its alarms and the controller's actions
(``callbacks/drift=monitor|controller``). Panels whose metrics the run did not log say so.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path


def load(run: Path) -> list[dict[str, float]]:
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in rows]


def series(rows: list[dict[str, float]], x: str, y: str) -> tuple[list[float], list[float]]:
    pts = sorted((r[x], r[y]) for r in rows if x in r and y in r)
    return [p[0] for p in pts], [p[1] for p in pts]


def posthoc_points(run: Path, rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """The post-hoc held-out curve (``heldout_curve.json``, written by ``lab.modes`` /
    ``lab.drift_grid`` runs, which train without inline evaluation) as eval rows, placed at
    their training wall-clock; none when the run evaluated inline."""
    path = run / "heldout_curve.json"
    if any("eval/reward_mean" in r for r in rows) or not path.exists():
        return []
    points = json.loads(path.read_text()).get("points", [])
    keys = ("eval/reward_mean", "eval/sampled_reward_mean")
    return [
        {"step": p["step"], "perf/wall_s": p["train_wall_s"], "perf/samples_total": p["samples"]}
        | {k: p[k] for k in keys if k in p}
        for p in points
        if "train_wall_s" in p and "samples" in p
    ]


def render(run: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load(run)
    # eval rows have no wall clock: place them at the wall time of the same step
    wall = {r["step"]: r["perf/wall_s"] for r in rows if "perf/wall_s" in r and "step" in r}
    samples = {r["step"]: r["perf/samples_total"] for r in rows if "perf/samples_total" in r and "step" in r}

    def nearest(table: dict[float, float], step: float) -> float:
        """Value at the last logged step <= step (evaluations run after that step)."""
        before = [s for s in table if s <= step]
        return table[max(before)] if before else 0.0

    for r in rows:
        if "eval/reward_mean" in r and "step" in r:
            r.setdefault("perf/wall_s", nearest(wall, r["step"]))
            r.setdefault("perf/samples_total", nearest(samples, r["step"]))
    rows += posthoc_points(run, rows)

    fig, ax = plt.subplots(2, 5, figsize=(26, 8))
    a = ax[0][0]
    for key, style in [
        ("train/reward_mean", "-"),
        ("eval/reward_mean", "o-"),
        ("eval/sampled_reward_mean", "s-"),
    ]:
        a.plot(*series(rows, "perf/wall_s", key), style, label=key)
    a.set_xlabel("wall-clock s")
    a.set_title("reward vs wall-clock")
    top = a.twiny()
    top.plot(*series(rows, "perf/samples_total", "train/reward_mean"), alpha=0)
    top.set_xlabel("trained samples")
    a.legend()

    a = ax[0][1]
    keys = [k for k in ("0", "1", "2", "3plus") if any(f"rollout/staleness_frac_{k}" in r for r in rows)]
    if keys:
        xs = [r["step"] for r in rows if "rollout/staleness_frac_0" in r]
        ys = [
            [r.get(f"rollout/staleness_frac_{k}", 0) for r in rows if "rollout/staleness_frac_0" in r]
            for k in keys
        ]
        a.stackplot(xs, ys, labels=[f"staleness {k}" for k in keys])
        a.legend(loc="lower left", fontsize=8)
    a.set_title("staleness histogram over steps")
    a.set_xlabel("step")

    a = ax[0][2]
    for key in ("is/weight_mean", "is/weight_max", "is/ess_frac", "train/kl_behavior"):
        xs, ys = series(rows, "step", key)
        if xs:
            a.plot(xs, ys, label=key)
    a.set_yscale("symlog", linthresh=1e-3)
    a.set_title("IS weights, ESS, behaviour KL")
    a.set_xlabel("step")
    a.legend(fontsize=8)

    a = ax[1][0]
    for key in ("train/response_len_mean", "train/response_len_max"):
        a.plot(*series(rows, "step", key), label=key)
    b = a.twinx()
    b.plot(*series(rows, "step", "bias/len_kl_trained_vs_issued"), "k--", label="len KL trained vs issued")
    b.set_ylabel("KL (nats)")
    a.set_title("response length (trained) and length bias")
    a.set_xlabel("step")
    a.legend(loc="upper left", fontsize=8)
    b.legend(loc="upper right", fontsize=8)

    a = ax[1][1]
    for key in ("perf/trainer_idle_frac", "perf/engine_idle_frac"):
        a.plot(*series(rows, "perf/wall_s", key), label=key)
    a.set_ylim(0, 1)
    a.set_title("idle fractions (cumulative)")
    a.set_xlabel("wall-clock s")
    a.legend(fontsize=8)

    a = ax[1][2]
    a.plot(*series(rows, "step", "perf/weight_sync_s"), label="weight sync s")
    a.plot(*series(rows, "step", "perf/weight_verify_s"), label="verify s")
    a.set_title("weight-sync time")
    a.set_xlabel("step")
    a.legend(fontsize=8)

    step_breakdown(ax[0][3], rows)
    drift_panel(ax[0][4], ax[1][4], rows)
    a = ax[1][3]
    a.plot(*series(rows, "perf/wall_s", "perf/samples_per_s"), label="trained samples/s")
    a.set_title("throughput (cumulative)")
    a.set_xlabel("wall-clock s")
    fig.suptitle(str(run))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


PHASES = ("gap", "wait", "prepare", "forward", "overhead", "backward", "optimizer")


def step_breakdown(a: object, rows: list[dict[str, float]]) -> None:
    """Stacked seconds per optimizer step by phase (``modules/callbacks/step_timer.py``)."""
    timed = [r for r in rows if "perf/step_s" in r and "step" in r]
    if not timed:
        a.text(0.5, 0.5, "no perf/step_* metrics in this run", ha="center", transform=a.transAxes)
    else:
        xs = [r["step"] for r in timed]
        ys = [[r.get(f"perf/step_{p}_s", 0.0) for r in timed] for p in PHASES]
        a.stackplot(xs, ys, labels=PHASES)
        a.legend(loc="upper left", fontsize=7)
    a.set_title("seconds per optimizer step, by phase")
    a.set_xlabel("step")


def drift_panel(a: object, b: object, rows: list[dict[str, float]]) -> None:
    """Top: the drift score with its alarms; bottom: the controller's knobs (lr scale, bound)."""
    xs, ys = series(rows, "step", "drift/score")
    if not xs:
        for axis in (a, b):
            axis.text(
                0.5,
                0.5,
                "no drift monitor in this run\n(callbacks/drift=monitor)",
                ha="center",
                transform=axis.transAxes,
            )
    else:
        a.plot(xs, ys, label="drift/score")
        alarms = [r["step"] for r in rows if r.get("drift/alarm", 0) > 0 and "step" in r]
        a.plot(alarms, [max(ys)] * len(alarms), "rv", label="alarm")
        for key in sorted({k for r in rows for k in r if k.startswith("drift/z/")}):
            a.plot(*series(rows, "step", key), ":", alpha=0.6, label=key[len("drift/z/") :])
        a.legend(fontsize=7)
        xs, ys = series(rows, "step", "controller/lr_scale")
        if xs:
            b.step(xs, ys, where="post", label="lr scale")
            c = b.twinx()
            c.step(
                *series(rows, "step", "controller/staleness_bound"),
                "k--",
                where="post",
                label="staleness bound",
            )
            cap = [
                (x, y) for x, y in zip(*series(rows, "step", "controller/weight_limit")) if math.isfinite(y)
            ]
            if cap:
                b.plot(*zip(*cap), "g.", markersize=3, label="correction weight cap")
            c.set_ylabel("staleness bound (versions)")
            c.legend(loc="upper right", fontsize=8)
            b.legend(loc="upper left", fontsize=8)
        else:
            b.text(0.5, 0.5, "monitor only: no controller actions", ha="center", transform=b.transAxes)
    a.set_title("drift score (robust z or ceiling) and alarms")
    a.set_xlabel("step")
    b.set_title("controller: lr scale, weight cap and staleness bound")
    b.set_xlabel("step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = render(args.run, args.out or args.run / "dashboard.png")
    print(out)


if __name__ == "__main__":
    main()
