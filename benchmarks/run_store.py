"""A committed record of finished benchmark runs, so an experiment can outlive its session.

    python -m benchmarks.drift --resume --store benchmarks/results/drift_grid_3e-3.jsonl ...

A long grid (``benchmarks.drift``: ~4 min a run, 90 runs) takes several sessions, and a
session's ``outputs/`` is not kept: a fresh checkout starts without it. The store is one JSON
line per finished run (``spec``, ``seed``, the commit it ran on, the warm start's and the final
held-out evaluation, and the metrics rows an analysis reads), small enough to commit (~20 kB a
run). ``--resume`` skips what the store already holds; ``--analyze`` reads the store and any run
directories together. Rows keep the logged strings as ``metrics.csv`` has them, so an analysis
reads a stored run exactly as it reads a run directory.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks.modes import read_metrics

# what a drift analysis reads: the step, the loss (marks a trained step), the reward, the lag,
# the detector's signals and diagnostics, the controller's actions, the throughput
KEEP_PREFIXES = ("train/", "is/", "mismatch/", "drift/", "controller/", "eval/")
KEEP_KEYS = ("step", "rollout/staleness_max", "perf/samples_per_s", "perf/tokens_per_s", "perf/wall_s")


def keep(key: str) -> bool:
    return key in KEEP_KEYS or key.startswith(KEEP_PREFIXES)


def trim(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The rows' kept, non-empty fields; rows left with nothing but a step are dropped."""
    out = []
    for r in rows:
        kept = {k: v for k, v in r.items() if v not in ("", None) and keep(k)}
        if set(kept) - {"step"}:
            out.append(kept)
    return out


CODE = ("train.py", "modules", "data", "conf", "recipes", "benchmarks", ":(exclude)benchmarks/results")


def commit() -> str:
    """The checkout's commit, ``+dirty`` with uncommitted changes to what a run executes (the
    code, configs and recipes; not docs, nor the stores themselves), or ``unknown``."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE],
            cwd=root,
            capture_output=True,
            text=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def record(run_dir: Path, spec: str, seed: int, start_sampled: float, error: str | None = None) -> dict:
    """One finished run as a store line. ``last`` is None for a run that stopped before its
    final evaluation (non-finite losses, a crash: ``error`` holds the tail of its stderr)."""
    summary = run_dir / "eval_summary.json"
    last = json.loads(summary.read_text())["last"] if summary.exists() else None
    rows = read_metrics(run_dir) if (run_dir / "metrics.csv").exists() else []
    return {
        "spec": spec,
        "seed": seed,
        "commit": commit(),
        "start_sampled": start_sampled,
        "last": last,
        "error": error,
        "rows": trim(rows),
    }


def load(store: Path) -> dict[tuple[str, int], dict]:
    """(spec, seed) -> record; a later line for the same run replaces an earlier one."""
    if not store.exists():
        return {}
    records = (json.loads(line) for line in store.read_text().splitlines() if line.strip())
    return {(r["spec"], r["seed"]): r for r in records}


def append(store: Path, rec: dict) -> None:
    store.parent.mkdir(parents=True, exist_ok=True)
    with open(store, "a") as f:
        f.write(json.dumps(rec, separators=(",", ":")) + "\n")
