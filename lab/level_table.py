"""Does a recipe lose a level? Per-level final reward against a reference, paired by seed.

    python -m lab.level_table outputs/bench/tail6.log --reference sync_grpo \\
        --runs outputs/bench/tail6/seed{seed}    # optional: where each seed's runs live

Reads the per-run records ``lab.modes`` prints to stderr (one JSON object per run; several
logs may be joined). For each recipe and each difficulty level: the final held-out sampled and
greedy reward (mean and 95 % t interval over seeds) and its difference to the reference, paired
by seed (runs of one seed ran in one sitting), with a 95 % t interval. A level is *lost* when
that interval lies wholly below 0: the recipe ends the level below the reference beyond the
noise. With ``--runs``, also the staleness bound's counters from each run's ``metrics.csv``
(``rollout/over_bound``, ``rollout/regenerated``, ``rollout/dropped``; the maximum staleness).
Where the records carry a post-hoc curve (``lab.modes --eval-every N``), also each recipe's
fall from its curve's peak to its final point (``bench_metrics.fall_from_peak``), sampled and
greedy, and its difference to the reference's, paired by seed: a late fall is shown when that
interval lies wholly above 0. Prints Markdown; ``--json`` prints the numbers instead.

A ``lab.modes --eval-every 0`` sitting has no post-hoc curve (its records' ``curve_last`` is
empty): the final figures are then each run's last in-run evaluation (``eval_summary.json``,
read with ``--runs``). ``--store FILE`` writes the records with both filled in, so the table
can be redone from that file alone:

    python -m lab.level_table outputs/bench/agent_partial.log --runs "outputs/bench/agent_partial/seed{seed}" \
        --reference "<spec>" --store lab/results/agent_partial/runs.jsonl
    python -m lab.level_table lab/results/agent_partial/runs.jsonl --reference "<spec>"
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

from lab.bench_metrics import fall_from_peak, mean_ci
from lab.modes_run import run_dir_name

COUNTERS = ("rollout/over_bound", "rollout/regenerated", "rollout/dropped")


def read_runs(logs: list[Path], runs_root: str | None = None) -> dict[str, dict[int, dict]]:
    """recipe spec -> seed -> its record (the last one wins when a seed ran twice). With
    ``runs_root``, a record without a post-hoc curve takes its run's last in-run evaluation as
    ``curve_last``, and every record its run's bound ``counters``."""
    runs: dict[str, dict[int, dict]] = {}
    for log in logs:
        for line in log.read_text().splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if "recipe" not in rec or "seed" not in rec:
                continue
            if runs_root is not None:
                run_dir = Path(runs_root.format(seed=rec["seed"])) / run_dir_name(rec["recipe"])
                run_dir = run_dir / f"seed{rec['seed']}"
                if not rec.get("curve_last"):
                    rec["curve_last"] = json.loads((run_dir / "eval_summary.json").read_text())["last"]
                rec["counters"] = counters(run_dir)
            if rec.get("curve_last"):  # a run with no final evaluation has no place in the table
                runs.setdefault(rec["recipe"], {})[int(rec["seed"])] = rec
    return runs


def level_keys(runs: dict[str, dict[int, dict]]) -> list[str]:
    keys = {k for seeds in runs.values() for r in seeds.values() for k in r["curve_last"]}
    return sorted(k.rsplit("_", 1)[1] for k in keys if re.fullmatch(r"eval/sampled_reward_level\d+", k))


def counters(run_dir: Path) -> dict[str, float]:
    """The last logged value of each bound counter and the largest staleness of the run."""
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    out = {}
    for key in (*COUNTERS, "rollout/staleness_max"):
        vals = [float(r[key]) for r in rows if r.get(key)]
        if vals:
            out[key] = max(vals) if key == "rollout/staleness_max" else vals[-1]
    return out


def falls(seeds: dict[int, dict], kind: str) -> dict[int, float]:
    """Each seed's fall from its curve's peak (``kind``: sampled or greedy)."""
    return {s: fall_from_peak([p[kind] for p in r["curve"]]) for s, r in seeds.items()}


def compare(runs: dict[str, dict[int, dict]], reference: str) -> dict:
    if reference not in runs:
        raise SystemExit(f"--reference {reference!r} is not among the records' specs: {sorted(runs)}")
    ref = runs[reference]
    out = {}
    for spec, seeds in runs.items():
        row: dict = {"seeds": sorted(seeds)}
        for level in ["mean", *level_keys(runs)]:
            for kind, prefix in (("sampled", "eval/sampled_reward_"), ("greedy", "eval/reward_")):
                key = prefix + level
                vals = [seeds[s]["curve_last"].get(key) for s in sorted(seeds)]
                diffs = [
                    seeds[s]["curve_last"][key] - ref[s]["curve_last"][key] for s in sorted(seeds) if s in ref
                ]
                d = mean_ci(diffs)
                row[f"{kind}/{level}"] = {
                    "value": mean_ci(vals),
                    "minus_reference": d,
                    "lost": d["hi"] is not None and d["hi"] < 0,
                }
        if all(len(r.get("curve") or []) > 1 for r in (*seeds.values(), *ref.values())):
            for kind in ("sampled", "greedy"):
                fall, ref_fall = falls(seeds, kind), falls(ref, kind)
                d = mean_ci([fall[s] - ref_fall[s] for s in sorted(seeds) if s in ref_fall])
                row[f"fall/{kind}"] = {
                    "value": mean_ci([fall[s] for s in sorted(seeds)]),
                    "minus_reference": d,
                    "late_fall": d["lo"] is not None and d["lo"] > 0,
                }
        if all("counters" in r for r in seeds.values()):
            per = [seeds[s]["counters"] for s in sorted(seeds)]
            row["counters"] = {
                k: mean_ci([p.get(k) for p in per]) for k in (*COUNTERS, "rollout/staleness_max")
            }
            row["counters"]["rollout/staleness_max"]["max"] = max(
                p.get("rollout/staleness_max", 0) for p in per
            )
        out[spec] = row
    return out


def fmt(d: dict) -> str:
    if d["mean"] is None:
        return "-"
    if d["lo"] is None:
        return f"{d['mean']:+.3f}"
    text = f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"
    return f"*{text}*" if d["lo"] <= 0 <= d["hi"] else f"**{text}**"


def markdown(table: dict, reference: str) -> str:
    lines = []
    for kind in ("sampled", "greedy"):
        levels = [k.split("/", 1)[1] for k in next(iter(table.values())) if k.startswith(kind + "/")]
        lines += [
            f"Final held-out {kind} reward per level: mean over seeds; below it, minus `{reference}` "
            "paired by seed, 95 % t interval (italics: holds 0; bold: beyond the noise)",
            "",
            "| recipe | n | " + " | ".join(levels) + " | levels lost |",
            "|---|---|" + "---|" * (len(levels) + 1),
        ]
        for spec, row in table.items():
            cells = []
            for lv in levels:
                c = row[f"{kind}/{lv}"]
                v = c["value"]["mean"]
                cells.append(f"{v:.3f}" + ("" if spec == reference else f"<br>{fmt(c['minus_reference'])}"))
            lost = [lv for lv in levels if lv != "mean" and row[f"{kind}/{lv}"]["lost"]]
            lines.append(
                f"| `{spec}` | {len(row['seeds'])} | "
                + " | ".join(cells)
                + f" | {', '.join(lost) or 'none'} |"
            )
        lines.append("")
    if any("fall/sampled" in r for r in table.values()):
        lines += [
            "Fall from the curve's peak to its final point (highest evaluation minus the last): "
            f"mean over seeds; below it, minus `{reference}`'s, paired by seed, 95 % t interval "
            "(italics: holds 0; bold: beyond the noise; a late fall when above 0)",
            "",
            "| recipe | n | sampled | greedy | late fall |",
            "|---|---|---|---|---|",
        ]
        for spec, row in table.items():
            if "fall/sampled" not in row:
                continue
            cells = [
                f"{row[f'fall/{k}']['value']['mean']:.3f}"
                + ("" if spec == reference else f"<br>{fmt(row[f'fall/{k}']['minus_reference'])}")
                for k in ("sampled", "greedy")
            ]
            late = [k for k in ("sampled", "greedy") if row[f"fall/{k}"]["late_fall"]]
            lines.append(
                f"| `{spec}` | {len(row['seeds'])} | {' | '.join(cells)} | {', '.join(late) or 'none'} |"
            )
        lines.append("")
    if any("counters" in r for r in table.values()):
        lines += [
            "| recipe | over_bound | regenerated | dropped | largest staleness |",
            "|---|---|---|---|---|",
        ]
        for spec, row in table.items():
            c = row.get("counters", {})

            def m(k: str, c: dict = c) -> str:
                return "-" if k not in c or c[k]["mean"] is None else f"{c[k]['mean']:.1f}"

            big = c.get("rollout/staleness_max", {}).get("max", "-")
            lines.append(f"| `{spec}` | {m(COUNTERS[0])} | {m(COUNTERS[1])} | {m(COUNTERS[2])} | {big} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", type=Path, nargs="+")
    parser.add_argument("--reference", default="sync_grpo")
    parser.add_argument(
        "--runs", help="each seed's lab.modes --out, with {seed} (reads the bound's counters)"
    )
    parser.add_argument(
        "--store", type=Path, help="write the records, final evaluation and counters filled in"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = read_runs(args.logs, args.runs)
    table = compare(runs, args.reference)  # before --store writes: a bad reference leaves it as it was
    if args.store:
        args.store.write_text(
            "".join(json.dumps(r) + "\n" for seeds in runs.values() for r in seeds.values())
        )
    print(json.dumps(table, indent=1) if args.json else markdown(table, args.reference))


if __name__ == "__main__":
    main()
