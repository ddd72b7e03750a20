"""The last in-run held-out evaluation of each arm, paired per seed against a reference.

    python -m lab.final_eval_table outputs/bench/agent_partial.log \
        --runs "outputs/bench/agent_partial/seed{seed}" --reference "<spec>" \
        --store lab/results/agent_partial/runs.jsonl       # records + their final evaluation
    python -m lab.final_eval_table lab/results/agent_partial/runs.jsonl --reference "<spec>"

For ``lab.modes --eval-every 0`` sittings: there is no post-hoc curve, so the per-level figures
``lab.level_table`` reads (``curve_last``) are absent; they are in each run's
``eval_summary.json`` (``last``), which ``--runs`` reads and ``--store`` keeps beside each
record (``final_eval``), so the table can be redone from the stored file alone. Every interval
has the seed as the unit (``lab.bench_metrics``). Prints Markdown, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lab.bench_metrics import paired_per_seed_ci, per_seed_ci
from lab.level_table import counters
from lab.modes_run import run_dir_name

FIGURES = ("dropped_groups", "train_wall_s", "samples_per_s", "staleness_mean", "staleness_max")


def read(log: Path, runs: str | None) -> dict[str, dict[int, dict]]:
    """spec -> seed -> its record, with ``final_eval`` (and the bound counters) from its run
    directory when ``runs`` is given (the last record of a seed wins)."""
    out: dict[str, dict[int, dict]] = {}
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line) if line.startswith("{") else {}
        except json.JSONDecodeError:
            continue  # a stderr line that happens to start with a brace
        if "recipe" not in rec or "seed" not in rec:
            continue
        if runs is not None:
            run_dir = Path(runs.format(seed=rec["seed"])) / run_dir_name(rec["recipe"]) / f"seed{rec['seed']}"
            rec["final_eval"] = json.loads((run_dir / "eval_summary.json").read_text())["last"]
            rec["counters"] = counters(run_dir)
        out.setdefault(rec["recipe"], {})[int(rec["seed"])] = rec
    return out


def levels(runs: dict[str, dict[int, dict]]) -> list[str]:
    """The levels every record's final evaluation has."""
    have = [{k.rsplit("level", 1)[1] for k in r["final_eval"] if k.startswith("eval/sampled_reward_level")}
            for seeds in runs.values() for r in seeds.values()]  # fmt: skip
    return sorted(set.intersection(*have)) if have else []


def table(runs: dict[str, dict[int, dict]], reference: str) -> dict:
    if reference not in runs:
        raise SystemExit(f"--reference {reference!r} is not among the records' specs: {sorted(runs)}")
    lv = levels(runs)
    keys = ["eval/sampled_reward_mean", *(f"eval/sampled_reward_level{i}" for i in lv)]
    keys += ["eval/reward_mean", *(f"eval/reward_level{i}" for i in lv)]
    ref = runs[reference]
    out: dict = {"levels": lv}
    for spec, seeds in runs.items():
        row: dict = {"n": len(seeds)}
        for k in keys:
            vals = {s: [r["final_eval"][k]] for s, r in seeds.items()}
            row[k] = per_seed_ci(vals)
            if spec != reference:
                row[k + " minus reference"] = paired_per_seed_ci(
                    vals, {s: [r["final_eval"][k]] for s, r in ref.items()}
                )
        for k in FIGURES:
            row[k] = per_seed_ci({s: [r[k]] for s, r in seeds.items()})
        for k in ("rollout/regenerated", "rollout/dropped"):
            row[k] = per_seed_ci({s: [r.get("counters", {}).get(k, 0.0)] for s, r in seeds.items()})
        out[spec] = row
    return out


def markdown(t: dict, reference: str) -> str:
    def ci(c: dict) -> str:
        if c.get("lo") is None:  # fewer than 2 paired seeds: no interval
            return "n/a" if c.get("mean") is None else f"{c['mean']:+.3f} (n = {c['n']})"
        return f"{c['mean']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] (n = {c['n']})"

    lines = [
        f"Final in-run held-out reward (mean over seeds; paired: minus `{reference}` by seed, 95 % t)",
        "",
        f"| arm | n | sampled | paired | level {' / '.join(t['levels'])} paired | greedy paired | dropped | regenerated "
        "| train wall s | samples/s | staleness mean / max |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for spec, r in t.items():
        if spec == "levels":
            continue
        paired = spec != reference
        levels = (
            " / ".join(ci(r[f"eval/sampled_reward_level{i} minus reference"]) for i in t["levels"])
            if paired
            else ""
        )
        lines.append(
            f"| `{spec}` | {r['n']} | {r['eval/sampled_reward_mean']['mean']:.3f} "
            f"| {ci(r['eval/sampled_reward_mean minus reference']) if paired else ''} | {levels} "
            f"| {ci(r['eval/reward_mean minus reference']) if paired else ''} "
            f"| {r['dropped_groups']['mean']:.1f} | {r['rollout/regenerated']['mean']:.1f} "
            f"| {r['train_wall_s']['mean']:.0f} | {r['samples_per_s']['mean']:.1f} "
            f"| {r['staleness_mean']['mean']:.2f} / {r['staleness_max']['mean']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--reference", required=True)
    parser.add_argument("--runs", help="each seed's lab.modes --out, with {seed}")
    parser.add_argument("--store", type=Path, help="write the records with their final evaluation")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = read(args.log, args.runs)
    t = table(runs, args.reference)  # before --store writes: a bad reference leaves the store as it was
    if args.store:
        args.store.write_text(
            "".join(json.dumps(r) + "\n" for seeds in runs.values() for r in seeds.values())
        )
    print(json.dumps(t, indent=1) if args.json else markdown(t, args.reference))


if __name__ == "__main__":
    main()
