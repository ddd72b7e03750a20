"""Where the drift grid's runs live: run directories under ``--out`` and the committed run store
(``lab/run_store.py``): finding a finished run, storing it, resuming a grid, one worker per run.

Imported by ``lab.drift_grid`` (run that: ``python -m lab.drift_grid --resume --store ...``);
``start_reward`` also by ``lab.detector_eval``. Run directories -> records, records -> the store;
nothing here judges a run (``lab.drift_outcome`` does).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

from lab import run_store
from lab.drift_cells import short
from lab.modes_run import read_metrics, run_dir_name


def dir_run(run_dir: Path) -> tuple[list[dict[str, str]], dict | None, list[dict]]:
    """A run directory's metrics rows, final held-out evaluation (None: there is none) and
    held-out curve (``run_store.curve_points``; empty: there is none)."""
    rows = read_metrics(run_dir) if (run_dir / "metrics.csv").exists() else []
    summary_path = run_dir / "eval_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return rows, summary.get("last"), run_store.curve_points(summary.get("history") or [])


def is_finished(run_dir: Path) -> bool:
    """A run wrote its last two files: the post-hoc held-out curve, then the summary read from it."""
    return all((run_dir / f).exists() for f in ("heldout_curve.json", "eval_summary.json"))


def find_run(
    out: Path, spec: str, seed: int, stored: dict | None
) -> tuple[list[dict[str, str]], dict | None, list[dict]] | None:
    """A run's (rows, last, curve): from the store first, else from its directory under ``out``.
    Without a store, a directory with no held-out curve is a run that stopped early (non-finite
    losses); with one (which holds such runs), it is unfinished (still going, crashed, killed):
    None, as for a run that is nowhere."""
    if stored and (spec, seed) in stored:
        rec = stored[(spec, seed)]
        return rec["rows"], rec["last"], rec.get("curve") or []
    run_dir = out / run_dir_name(spec) / f"seed{seed}"
    if (run_dir / "metrics.csv").exists() and (is_finished(run_dir) or stored is None):
        return dir_run(run_dir)
    return None


def start_reward(out: Path | None, stored: dict | None = None) -> float:
    """The warm start's held-out sampled reward: the initial evaluations cached under ``out``
    and the one each stored run began from, which must agree to 1e-6: a store holds one build of
    the warm start (rebuilt on another machine, it differs in its last bits and its runs do not
    pair with these: keep them in another store, read beside this one with ``--with-store``);
    NaN with none of them."""
    starts = [rec["start_sampled"] for rec in (stored or {}).values()]
    starts += [
        json.loads(p.read_text())["metrics"]["eval/sampled_reward_mean"]
        for p in ((out / "initial_eval").glob("*.json") if out is not None else ())  # None: the store's only
    ]
    distinct = {round(x, 6) for x in starts if x is not None and math.isfinite(x)}
    hashes = warm_start_hashes(stored or {})
    if len(distinct) > 1 or len(hashes) > 1:
        raise SystemExit(
            f"runs from different warm starts (held-out sampled {sorted(distinct)}, weights "
            f"{sorted(h[:12] for h in hashes)}): not comparable; a store holds one build (another "
            "build's runs: another store, read with --with-store)"
        )
    return next((x for x in starts if x is not None and math.isfinite(x)), math.nan)


def pending_seeds(out: Path, spec: str, seeds: list[int], stored: dict | None = None) -> list[int]:
    """The seeds of ``spec`` with no finished run under ``out`` (finished: its post-hoc held-out
    curve was written, the last thing a run does) nor in the ``stored`` records; a partial
    directory left by a killed run is removed, so that the rerun starts clean."""
    todo = []
    for seed in seeds:
        run_dir = out / run_dir_name(spec) / f"seed{seed}"
        if is_finished(run_dir) or (spec, seed) in (stored or {}):
            continue
        if run_dir.exists():
            shutil.rmtree(run_dir)
        todo.append(seed)
    return todo


@contextlib.contextmanager
def run_lock(out: Path, spec: str, seed: int) -> Iterator[bool]:
    """Hold ``seed<N>.lock`` beside the run's directory while it runs; yields False when
    another worker holds it (two workers on one run would write into one directory). The lock
    is the OS's (``flock``): a killed worker releases it."""
    path = out / run_dir_name(spec) / f"seed{seed}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def other_build(rec: dict, stored: dict) -> str | None:
    """Why ``rec`` began from another build of the warm start than the ``stored`` runs (its
    weight hash or its held-out start differs from theirs), or None."""
    starts = {round(r["start_sampled"], 6) for r in stored.values() if _finite(r.get("start_sampled"))}
    hashes = warm_start_hashes(stored)
    if rec.get("warm_start") and hashes and rec["warm_start"] not in hashes:
        return (
            f"its warm start's weights {rec['warm_start'][:12]} are not the store's {sorted(hashes)[0][:12]}"
        )
    if _finite(rec.get("start_sampled")) and starts and round(rec["start_sampled"], 6) not in starts:
        return (
            f"its warm start evaluates at {rec['start_sampled']:.6f}, the store's at {sorted(starts)[0]:.6f}"
        )
    return None


def warm_start_hashes(stored: dict) -> set[str]:
    """The warm-start weight hashes the ``stored`` runs recorded (older runs recorded none)."""
    return {rec.get("warm_start") for rec in stored.values()} - {None}


def _finite(x: object) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def archive(out: Path, spec: str, results: list[dict], store: Path, stored: dict, setup: dict) -> None:
    """Append ``spec``'s finished runs that the store lacks: those with a held-out evaluation, and
    those that stopped on non-finite losses (``run_recipe``'s ``diverged``: an outcome of the
    experiment); a run that failed otherwise (an engine crash, a kill) is not stored, so
    ``--resume`` runs it again."""
    for result in results:
        seed = result["seed"]
        run_dir = out / run_dir_name(spec) / f"seed{seed}"
        finished = is_finished(run_dir)
        if (spec, seed) in stored or not (finished or result.get("diverged")):
            continue
        rec = run_store.record(run_dir, spec, seed, setup, None if finished else result["error"])
        reason = other_build(rec, stored)
        if reason:
            raise SystemExit(
                f"{run_dir} is not stored in {store}: {reason}. This machine's warm start is another "
                "build than the store's: give it its own store (and its own K = 0 runs) and read "
                "this one beside it with --with-store"
            )
        run_store.append(store, rec)
        stored[(spec, seed)] = rec


def sweep(out: Path, specs: list[str], seeds: list[int], store: Path, stored: dict, setup: dict) -> None:
    """Store the finished runs under ``out`` that the store lacks (a worker killed between
    finishing a run and storing it), each under its run lock: a run another worker holds may be
    between its last two files, and is left to that worker to store."""
    for spec in specs:
        for seed in seeds:
            with run_lock(out, spec, seed) as mine:
                if mine:
                    archive(out, spec, [{"seed": seed}], store, stored, setup)


def check_setup(stored: dict, specs: list[str], setup: dict) -> None:
    """Refuse a store whose runs of these cells ran with other overrides or evaluation interval:
    ``--resume`` would skip them and the table would mix two experiments."""
    for (spec, seed), rec in stored.items():
        theirs = {k: rec.get(k) for k in ("overrides", "eval_every")}
        ours = {k: setup[k] for k in theirs}
        if spec in specs and theirs != ours:
            raise SystemExit(
                f"the store's {short(spec)} seed {seed} ran with {theirs}, this command has {ours}"
            )
