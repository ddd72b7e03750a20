"""A committed record of finished benchmark runs, so an experiment can outlive its session.

    python -m lab.drift_grid --resume --store lab/results/drift_grid_3e-3.jsonl ...

A long grid (``lab.drift_grid``: ~4-5 min a run, 90 runs) takes several sessions, and a
session's ``outputs/`` is not kept: a fresh checkout starts without it. The store is one JSON
line per finished run: ``spec``, ``seed``, the extra overrides and evaluation interval it ran
with, the commit it ran on, its warm start's weights' hash and held-out evaluation, its final
one, every held-out point (``curve``), and the metrics rows an analysis reads (~70 kB a run,
so ~6 MB for a 90-run grid). ``--resume`` skips what the store holds; ``--analyze`` reads the
store and the finished run directories together. Rows keep the logged strings of
``metrics.csv`` (the columns in ``keep``), so an analysis of those columns gives the same
result on a stored run as on its directory.
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

from lab.modes_run import read_metrics

# what a drift analysis reads: the step, the loss (marks a trained step), the reward, the lag,
# the detector's signals and diagnostics, the controller's actions, the throughput
KEEP_PREFIXES = ("train/", "is/", "mismatch/", "drift/", "controller/", "eval/", "ratio/")
KEEP_KEYS = ("step", "rollout/staleness_max", "perf/samples_per_s", "perf/tokens_per_s", "perf/wall_s")
# what a run executes (a change here makes the commit ``+dirty``); not docs, nor the stores
CODE_PATHSPECS = (
    "train.py",
    "modules",
    "data",
    "conf",
    "recipes",
    "tools",
    "lab",
    "pyproject.toml",
    "requirements-cpu.txt",
    ":(exclude)lab/results",
)


def keep(key: str) -> bool:
    return key in KEEP_KEYS or key.startswith(KEEP_PREFIXES)


def trim(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The rows' kept, non-empty fields (a row with nothing kept, not even a step, is dropped)."""
    out = []
    for r in rows:
        kept = {k: v for k, v in r.items() if v not in ("", None) and keep(k)}
        if kept:
            out.append(kept)
    return out


def commit() -> str:
    """The checkout's commit, ``+dirty`` with uncommitted or untracked files among what a run
    executes (``CODE_PATHSPECS``), or ``unknown``."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all", "--", *CODE_PATHSPECS],
            cwd=root,
            capture_output=True,
            text=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def record(run_dir: Path, spec: str, seed: int, setup: dict, error: str | None = None) -> dict:
    """One run as a store line. ``setup`` is what the spec does not say (the extra overrides,
    the evaluation interval, the commit). ``start_sampled`` is the run's own first held-out
    point (the warm start), None for a run that stopped before its evaluation; ``last`` is its
    final one, None for such a run (``error``: the tail of its stderr); ``curve``: every
    held-out point, trimmed (``curve_points``; absent in records written before it)."""
    summary = run_dir / "eval_summary.json"
    points = json.loads(summary.read_text()) if summary.exists() else {}
    rows = read_metrics(run_dir) if (run_dir / "metrics.csv").exists() else []
    first = points.get("first") or {}
    curve = run_dir / "heldout_curve.json"
    warm_start = json.loads(curve.read_text()).get("initial_weights") if curve.exists() else None
    return {
        "spec": spec,
        "seed": seed,
        **setup,
        "start_sampled": first.get("eval/sampled_reward_mean"),
        "warm_start": warm_start,  # sha256 of the warm start's weights (None in older records)
        "last": points.get("last"),
        "curve": curve_points(points.get("history") or []),
        "error": error,
        "rows": trim(rows),
    }


CURVE_KEYS = ("step", "eval/sampled_reward_mean", "eval/sampled_reward_se", "eval/reward_mean")


def curve_points(history: list[dict]) -> list[dict]:
    """The held-out curve a collapse can be dated on: each evaluated point's step, sampled
    reward (and its standard error) and greedy reward (a few hundred bytes a run)."""
    return [{k: p[k] for k in CURVE_KEYS if k in p} for p in history]


def load(store: Path) -> dict[tuple[str, int], dict]:
    """(spec, seed) -> record; a later line for the same run replaces an earlier one. A line
    cut short (a writer killed mid-line) is skipped with a warning: that run is not stored and
    ``--resume`` runs it again."""
    if not store.exists():
        return {}
    records = {}
    for i, line in enumerate(store.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            print(f"warning: {store}: line {i + 1} is cut short; skipped", file=sys.stderr)
            continue
        records[(rec["spec"], rec["seed"])] = rec
    return records


def append(store: Path, rec: dict) -> None:
    """One line, under an exclusive lock (several workers may share a store), on a line of its
    own even after a line cut short."""
    store.parent.mkdir(parents=True, exist_ok=True)
    with open(store, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0, 2)
            if f.tell():
                f.seek(-1, 2)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write(json.dumps(rec, separators=(",", ":")).encode() + b"\n")
            f.flush()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
