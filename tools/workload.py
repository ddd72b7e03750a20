"""Fit the pipeline simulator to a finished run, and predict other rollout configs on it.

    python -m tools.workload outputs/sync_grpo/<time>            # print the fitted workload
    python -m tools.plan --from-run outputs/sync_grpo/<time>     # candidates on that workload
    python -m tools.plan --from-run RUN --validate RUN_A RUN_B   # predicted vs measured

A run leaves what the simulator needs: ``experiences.jsonl`` (each trained sample's length,
level, group and generation start/end), ``metrics.csv`` (per-step timings) and
``.hydra/overrides.yaml`` (its config). The fit:

* **workload**: the run's trained groups, each with its G response lengths and its level,
  replayed as the prompt set (so the length mix, its correlation with difficulty and the spread
  within a group are the run's own);
* **engine**: one decoding iteration over n running requests costs ``a + b * n`` seconds and a
  request waits ``k`` iterations before its first token (prefill, scheduling). Fitted on each
  request's duration, ``d = (L + k) * (a + b * n_bar)`` (n_bar: the mean number of requests
  running over its iterations, counted from the same records): least squares in (a, b) for each
  k on a grid, the k with the smallest error kept. Continued (partial-rollout) requests are left
  out. A GPU engine decodes a batch in nearly constant time (b ~ 0); a CPU
  engine's iteration grows with the batch (b > 0), which is why the simulator's default one
  unit per token is wrong for vLLM-CPU;
* **trainer**: the mean time per optimizer step the trainer is busy (``perf/step_s`` minus the
  time spent waiting for the rollout), weight sync and verify included;
* **contention** (several runs): when generation and training share a machine (this 2-core CPU:
  the rollout threads share the trainer process), each slows the other. In a sync run they never
  overlap; in an async run the engine generates while the trainer is busy for a share u of the
  time (1 - trainer idle) and the trainer steps while the engine is busy (1 - engine idle). Given
  runs of both kinds, ``d = (L + k)(a + b n_bar)(1 + e u)`` (e on a grid) and
  ``step = t0 (1 + t v)`` are fitted; from one kind alone e = t = 0 and the run's own
  conditions are folded into the costs (a sync fit then overrates async configs, an async fit
  underrates sync).

Groups a run dropped are not in its records (a fit from a run that dropped long groups
under-weights them); pool runs that kept them (sync, partial, admission control).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Workload:
    groups: list[tuple[int, list[int]]]  # (level, the group's response lengths)
    step_cost: tuple[float, float]  # seconds per decoding iteration: a + b * running
    prefill_iterations: float  # iterations a request waits before its first token
    step_time: float  # trainer-busy seconds per optimizer step (engine idle)
    contention: tuple[float, float] = (0.0, 0.0)  # (engine e, trainer t) slowdowns when both run
    overrides: list[str] = field(default_factory=list)  # the run's Hydra overrides
    fit: dict = field(default_factory=dict)  # diagnostics: residuals, sample counts

    def summary(self) -> dict:
        lengths = [n for _, g in self.groups for n in g]
        out = asdict(self)
        out.pop("groups")
        out["groups"] = len(self.groups)
        out["length_mean"] = statistics.fmean(lengths)
        out["length_median"] = statistics.median(lengths)
        out["length_max"] = max(lengths)
        return out

    def tokens_per_s(self, running: int) -> float:
        """The fitted engine's decode rate with ``running`` requests at once (the calibration
        curve: vLLM-CPU's iteration grows with the batch, so this saturates at 1 / b)."""
        a, b = self.step_cost
        return running / (a + b * running)

    def bounds(self, batch: int, concurrency: int) -> dict:
        """Samples/s no schedule beats on this workload: the smaller of generation alone (every
        slot busy, each response its mean length plus the prefill) and training alone. On a
        shared machine overlap slows both (the fitted contention), so real pipelines stay
        further below it; a sync schedule never overlaps and pays none."""
        lengths = [n for _, g in self.groups for n in g]
        per_sample = (statistics.fmean(lengths) + self.prefill_iterations) / self.tokens_per_s(concurrency)
        gen = 1.0 / per_sample
        train = batch / self.step_time
        return {
            "generation_only_samples_per_s": gen,
            "training_only_samples_per_s": train,
            "pipeline_bound_samples_per_s": min(gen, train),
        }


def read_records(run: Path) -> list[dict]:
    path = run / "experiences.jsonl"
    if not path.exists():
        raise SystemExit(f"{path} not found: the planner fits a run that wrote experience records")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_overrides(run: Path) -> list[str]:
    import yaml

    path = run / ".hydra" / "overrides.yaml"
    return list(yaml.safe_load(path.read_text()) or []) if path.exists() else []


def mean_concurrency(
    starts: np.ndarray, ends: np.ndarray, cost: tuple[float, float] | None = None
) -> np.ndarray:
    """For each interval [s_i, e_i): the mean number of intervals open over it, averaged over
    time, or with ``cost=(a, b)`` over decoding iterations (an iteration with n running lasts
    a + b n, so busy stretches hold fewer iterations per second)."""
    times = np.concatenate([starts, ends])
    deltas = np.concatenate([np.ones_like(starts), -np.ones_like(ends)])
    order = np.argsort(times, kind="stable")
    times, deltas = times[order], deltas[order]
    running = np.cumsum(deltas)  # open count just after each event
    weight = np.ones_like(running) if cost is None else 1.0 / (cost[0] + cost[1] * np.maximum(running, 0))

    def integral(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        area = np.concatenate([[0.0], np.cumsum(values[:-1] * np.diff(times))])

        def at(t: np.ndarray) -> np.ndarray:
            i = np.clip(np.searchsorted(times, t, side="right") - 1, 0, len(times) - 1)
            return area[i] + values[i] * (t - times[i])

        return at(ends) - at(starts)

    return integral(running * weight) / np.maximum(integral(weight), 1e-12)


def fit_engine(
    records: list[dict], shared: np.ndarray | None = None, runs: np.ndarray | None = None
) -> tuple[tuple[float, float], float, float, dict]:
    """``d = (L + k) (a + b n_bar)`` over uncontinued requests: ((a, b), k, diagnostics).
    n_bar is averaged over the request's decoding iterations, which depends on (a, b): start
    from the time average and refit a few times (a fixed point; exact when the records hold
    every request the engine ran). ``shared``: per record, the share of its run's time the
    trainer was busy too; when it varies, the slowdown e of ``(1 + e * shared)`` is fitted.
    ``runs``: per record, which run it came from (concurrency is counted within a run)."""
    starts = np.array([r["gen_start"] for r in records], dtype=float)
    ends = np.array([r["gen_end"] for r in records], dtype=float)
    keep = np.array([not r.get("splits") and r["len"] > 0 for r in records])
    if keep.sum() < 10:
        raise SystemExit("fewer than 10 uncontinued requests with tokens: nothing to fit the engine on")
    length = np.array([r["len"] for r in records], dtype=float)[keep]
    d = (ends - starts)[keep]
    u = np.zeros(len(records)) if shared is None else np.asarray(shared, dtype=float)
    u = u[keep]
    slowdowns = np.arange(0.0, 2.01, 0.05) if np.ptp(u) > 0.05 else np.zeros(1)
    run_of = np.zeros(len(records), dtype=int) if runs is None else np.asarray(runs)
    cost = None
    for _ in range(4):
        n_all = np.zeros(len(records))
        for r in np.unique(run_of):
            sel = run_of == r
            n_all[sel] = mean_concurrency(starts[sel], ends[sel], cost)
        n_bar = n_all[keep]
        best = None
        for e in slowdowns:
            for k in np.arange(0.0, 48.5, 1.0):
                x = np.stack([length + k, (length + k) * n_bar], axis=1) * (1 + e * u)[:, None]
                coef = _nonneg_lstsq(x, d)
                err = float(np.sum((d - x @ coef) ** 2))
                if best is None or err < best[0]:
                    best = (err, float(k), float(e), coef, x)
        _, k, e, coef, x = best
        cost = (max(float(coef[0]), 1e-9), float(coef[1]))  # an iteration takes some time
    a, b = cost
    resid = d - x @ np.array([a, b])
    diag = {
        "requests": int(keep.sum()),
        "r2": float(1 - resid.var() / d.var()) if d.var() > 0 else 1.0,
        "mean_running": float(n_bar.mean()),
        "duration_mean_s": float(d.mean()),
    }
    return (a, b), k, e, diag


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (few columns: try every subset)."""
    best, best_err = np.zeros(x.shape[1]), float(np.sum(y**2))
    cols = range(x.shape[1])
    subsets = [[j for j in cols if mask >> j & 1] for mask in range(1, 2 ** x.shape[1])]
    for s in subsets:
        coef_s = np.linalg.lstsq(x[:, s], y, rcond=None)[0]
        if np.any(coef_s < 0):
            continue
        coef = np.zeros(x.shape[1])
        coef[s] = coef_s
        err = float(np.sum((y - x @ coef) ** 2))
        if err < best_err:
            best, best_err = coef, err
    return best


def trainer_step_time(run: Path) -> float:
    """Mean seconds per optimizer step the trainer is busy (not waiting for the rollout)."""
    busy = []
    with open(run / "metrics.csv") as f:
        for r in csv.DictReader(f):
            if r.get("perf/step_s"):
                busy.append(float(r["perf/step_s"]) - float(r.get("perf/step_wait_s") or 0.0))
    if not busy:
        raise SystemExit(f"{run}/metrics.csv has no perf/step_s: was the step timer off?")
    return statistics.fmean(busy[1:] if len(busy) > 1 else busy)  # the first step pays warm-up


def last_metric(run: Path, key: str) -> float | None:
    last = None
    with open(run / "metrics.csv") as f:
        for r in csv.DictReader(f):
            if r.get(key):
                last = float(r[key])
    return last


def is_sync(run: Path) -> bool:
    """Whether the run's rollout had the barrier (generation and training never overlap)."""
    import yaml

    path = run / ".hydra" / "config.yaml"
    if not path.exists():
        return any(o in ("recipe=sync_grpo", "rollout=sync") for o in read_overrides(run))
    target = (yaml.safe_load(path.read_text()).get("rollout") or {}).get("_target_", "")
    return target.endswith("SyncRollout")


def overlap(run: Path) -> tuple[float, float]:
    """(share of the run the trainer was busy, share the engine was busy); (0, 0) for sync,
    where the two never run at once."""
    if is_sync(run):
        return 0.0, 0.0
    idle_t = last_metric(run, "perf/trainer_idle_frac") or 0.0
    idle_e = last_metric(run, "perf/engine_idle_frac") or 0.0
    return 1.0 - idle_t, 1.0 - idle_e


def fit_trainer(steps: list[float], engine_busy: list[float]) -> tuple[float, float]:
    """``step = t0 (1 + t v)`` over runs (v: engine busy share): (t0, t). The line is
    extrapolated to v = 0 only when the runs span enough of v (a sync run, v = 0, with an async
    one) and it slopes up; otherwise (async runs alone, v 0.93 and 0.99: a 0.06 spread in
    noisy step times extrapolated to a 10 s step) t = 0 and t0 is the mean step."""
    v, s = np.asarray(engine_busy), np.asarray(steps)
    if np.ptp(v) < 0.25:
        return float(s.mean()), 0.0
    slope, t0 = np.polyfit(v, s, 1)
    if slope <= 0 or t0 <= 0:
        return float(s.mean()), 0.0
    return float(t0), float(slope) / float(t0)


def groups_of(records: list[dict]) -> list[tuple[int, list[int]]]:
    by_group: dict[int, list[dict]] = {}
    for r in records:
        by_group.setdefault(r["group"], []).append(r)
    out = []
    for _, rs in sorted(by_group.items()):
        rs.sort(key=lambda r: r["sample"])
        out.append((int(rs[0]["level"] or 0), [int(r["len"]) for r in rs]))
    return out


def fit(runs: Path | list[Path]) -> Workload:
    """One workload from one or more finished runs of the same task (their records pooled)."""
    runs = [runs] if isinstance(runs, Path) else list(runs)
    records, shared, run_ids, groups, steps, busy = [], [], [], [], [], []
    for i, run in enumerate(runs):
        rs = read_records(run)
        u, v = overlap(run)
        records += rs
        shared += [u] * len(rs)
        run_ids += [i] * len(rs)
        groups += groups_of(rs)
        steps.append(trainer_step_time(run))
        busy.append(v)
    step_cost, prefill, slow_e, diag = fit_engine(records, np.array(shared), np.array(run_ids))
    t0, slow_t = fit_trainer(steps, busy)
    diag["runs"] = [str(r) for r in runs]
    return Workload(
        groups=groups,
        step_cost=step_cost,
        prefill_iterations=prefill,
        step_time=t0,
        contention=(slow_e, slow_t),
        overrides=read_overrides(runs[0]),
        fit=diag,
    )


def measured_samples_per_s(run: Path) -> float:
    """The run's own figure: trained samples / training wall time (last logged value)."""
    last = last_metric(run, "perf/samples_per_s")
    if last is None:
        raise SystemExit(f"{run}/metrics.csv has no perf/samples_per_s")
    return last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--batch", type=int, default=128, help="samples per optimizer step (bounds)")
    parser.add_argument("--concurrency", type=int, default=256, help="engine slots (bounds)")
    args = parser.parse_args()
    work = fit(args.runs)
    curve = {n: round(work.tokens_per_s(n), 1) for n in (1, 8, 32, 64, 128, 256) if n <= args.concurrency}
    print(
        json.dumps(
            {**work.summary(), "tokens_per_s_by_running": curve, **work.bounds(args.batch, args.concurrency)}
        )
    )


if __name__ == "__main__":
    main()
