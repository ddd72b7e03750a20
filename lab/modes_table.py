"""The time-to-reward table of a ``lab.modes`` result, as Markdown.

    python -m lab.modes_table outputs/bench/modes/result.json

One row per recipe: final held-out sampled reward (mean and 95 % t interval over seeds), the
difference to the reference (Welch interval), per-level final sampled reward, greedy reward,
training wall time (mean +- sample std), time to 90 % of the reference's gain (t interval; n reached), its ratio to
the reference's (delta-method interval, bootstrap beside it), the sampled reward at half the
reference's wall time, samples/s, mean staleness and dropped groups per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def ci(d: dict | None, digits: int = 3) -> str:
    if not d or d.get("mean", d.get("value")) is None:
        return "-"
    m = d.get("mean", d.get("value"))
    if d.get("lo") is None:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} [{d['lo']:.{digits}f}, {d['hi']:.{digits}f}]"


def num(d: dict | None, digits: int = 3) -> str:
    return "-" if not d or d.get("mean") is None else f"{d['mean']:.{digits}f}"


def wall(d: dict | None) -> str:
    if not d or d.get("mean") is None:
        return "-"
    return f"{d['mean']:.0f}" + ("" if d.get("std") is None else f" +- {d['std']:.0f}")


def rows(result: dict) -> list[str]:
    levels = sorted(
        {
            k
            for r in result["recipes"].values()
            for k in r.get("power", {}).get("final", {})
            if k.startswith("eval/sampled_reward_level")
        }
    )
    head = [
        "recipe",
        "final sampled [95 % CI]",
        "minus reference",
        *[k.rsplit("_", 1)[1] for k in levels],
        "greedy",
        "train wall s",
        "time to 90 % gain s (n)",
        "time ratio [CI] (bootstrap)",
        "sampled at 0.5x ref wall",
        "samples/s",
        "staleness",
        "dropped groups",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in result["recipes"].items():
        p = r.get("power", {})
        final = p.get("final", {})
        t90 = p.get("time_to_90pct_gain_s", {})
        ratio = p.get("time_ratio_to_reference", {})
        boot = ratio.get("bootstrap") or {}
        half = (p.get("reward_at_equal_wall") or {}).get("0.5x_reference_wall")
        cells = [
            f"`{name}`",
            ci(final.get("eval/sampled_reward_mean")),
            ci(p.get("final_minus_reference")),
            *[num(final.get(k)) for k in levels],
            num(final.get("eval/reward_mean")),
            wall(p.get("train_wall_s")),
            f"{ci(t90, 0)} ({t90.get('n', 0)}/{t90.get('n_total', 0)})" if t90 else "-",
            (
                f"{ci(ratio, 2)} ({boot['lo']:.2f}-{boot['hi']:.2f})"
                if boot.get("lo") is not None
                else ci(ratio, 2)
            )
            if ratio
            else "-",
            ci(half),
            num(r.get("samples_per_s"), 1),
            num(r.get("staleness_mean"), 2),
            num(r.get("dropped_groups"), 0),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path)
    args = parser.parse_args()
    print("\n".join(rows(json.loads(args.result.read_text()))))


if __name__ == "__main__":
    main()
