"""The drift grid's comparisons pooled over several lags, with the seed as the unit.

    python -m lab.drift_grid --analyze outputs/bench/lag_mb4 --lags 0 1 2 4 8 --pool-lags 2 4 8 --markdown \\
        --store lab/results/lag_grid_mb4_5e-4_b2.jsonl --with-store lab/results/lag_grid_mb4_5e-4.jsonl \\
        -- algo.minibatches=4 module.optimizer.lr=5e-4

(reads the stores only, seconds of CPU). For each arm, its runs at the lags in ``--pool-lags``
are paired with a reference (``lab.drift_table.paired_runs``: its own K = 0 run, bypass's K = 0
run, or another arm at the same K; by seed within a build of the warm start); a seed's
differences at one lag (its runs of two builds) are averaged first, then its lag means, so every
lag weighs alike, and the mean and 95 % t interval are taken over seeds
(``bench_metrics.per_seed_ci``: n = seeds, df = n - 1). Pooling the (K, seed) pairs as
independent values instead would count one seed's shared prompts, and the one K = 0 run that
every lag of a seed subtracts, three or four times over (``per_seed_ci``'s docstring).
"""

from __future__ import annotations

import re

from lab import bench_metrics
from lab.drift_cells import ARMS, lag_of, short
from lab.drift_report import ci_text
from lab.drift_table import paired_runs, seed_ci

# reference -> what a difference is taken against (``paired_runs``'s references)
REFERENCES = {
    "k0": "its own K = 0",
    "k0:bypass": "bypass's K = 0",
    "bypass": "bypass at the same K",
    "decoupled": "plain decoupled at the same K",
}


def group_of(spec: str) -> str:
    """A cell's arm and its other overrides, without the lag ('K=8 tis +controller' -> 'tis
    +controller'): the cells whose runs one pooled value joins."""
    return re.sub(r"(^| )K=\d+", "", short(spec)).strip()


def pool(
    cells: dict[str, dict], lags: list[int], reference: str, key: str = "final_sampled"
) -> dict[str, dict]:
    """Each group's (``group_of``) paired differences to ``reference`` over the cells at
    ``lags``, the seed as the unit, every lag weighted alike: a seed's pairs at one lag (its
    runs of two builds) are averaged first, then its lag means, then the mean and t interval are
    taken over seeds (``seed_ci``). A lag with runs of two builds would otherwise count twice.
    ``n_pairs`` counts the pairs; ``reference_n`` those taken against plain decoupled's K = 0
    run (``paired_runs``'s fallback)."""
    groups: dict[str, dict] = {}
    for spec, p in paired_runs(cells, reference, key).items():
        if lag_of(spec) not in lags:
            continue
        g = groups.setdefault(group_of(spec), {"by_lag": {}, "via_alt": 0})
        g["by_lag"].setdefault(lag_of(spec), []).extend(p["pairs"])
        g["via_alt"] += p["via_alt"]
    out = {}
    for name, g in groups.items():
        lag_means = [
            (seed, mean)
            for pairs in g["by_lag"].values()
            for seed, mean in bench_metrics.seed_means(bench_metrics.by_seed(pairs)).items()
        ]
        out[name] = {**seed_ci(lag_means), "n_pairs": sum(len(p) for p in g["by_lag"].values())}
        if g["via_alt"]:
            out[name].update(reference="decoupled", reference_n=g["via_alt"])
    return out


def lags_to_pool(specs: list[str], requested: list[int] | None = None) -> list[int]:
    """The lags to pool over: ``requested`` (default: every lag > 0), kept only where a cell has
    it (a ``--mismatch`` grid, all at K = 0, has none)."""
    present = sorted({lag_of(spec) for spec in specs} - {0})
    return [k for k in requested or present if k in present]


def pooled(cells: dict[str, dict], lags: list[int]) -> dict:
    """Every pooled comparison of the table: ``vs``: {reference: {key: {group: ci}}} for the
    ``REFERENCES``, sampled (``final_sampled``) and greedy; ``arm_minus_arm``: {key: {a: {b: ci}}},
    arm a minus arm b at the same K, pooled over ``lags``."""
    keys = ("final_sampled", "greedy")
    return {
        "lags": lags,
        "vs": {ref: {k: pool(cells, lags, ref, k) for k in keys} for ref in REFERENCES},
        "arm_minus_arm": {k: {b: pool(cells, lags, b, k) for b in ARMS} for k in keys},
    }


def value_text(p: dict | None) -> str:
    """``ci_text`` without the reference note, or the bare mean where there is no interval (one
    seed)."""
    if not p:
        return ""
    return ci_text({**p, "reference": None}) or f"{p['mean']:+.3f}"


def entry(p: dict | None, seeds: int | None = None) -> str:
    """The value with its counts in one parenthesis: '+0.005 [-0.009, +0.018] (9 pairs)', the
    seeds named where they are not ``seeds`` (the table's common n): '(2 seeds, 5 pairs)', and
    the pairs taken against plain decoupled's K = 0 run: '(9 pairs, 3 vs plain decoupled's
    K = 0)', '(9 pairs, all vs ...)'."""
    if not p:
        return ""
    counts = [] if p["n"] == seeds else [f"{p['n']} seed{'s' * (p['n'] != 1)}"]
    counts.append(f"{p['n_pairs']} pair{'s' * (p['n_pairs'] != 1)}")
    if p.get("reference"):
        some = p.get("reference_n", p["n_pairs"])
        counts[-1] += f", {'all' if some == p['n_pairs'] else some} vs plain {p['reference']}'s K = 0"
    return f"{value_text(p)} ({', '.join(counts)})"


def markdown(result: dict) -> str:
    """The pooled comparisons as Markdown: each group against the references (sampled, greedy),
    and row minus column at the same K (sampled / greedy), the latter only where some pair has
    one. Empty where no group has a pair (no lagged cells, or no reference among them)."""
    lags = " / ".join(str(k) for k in result["lags"])
    vs = result["vs"]
    groups = list(dict.fromkeys(g for ref in vs.values() for by in ref.values() for g in by))
    if not groups:
        return ""
    cols = [(ref, k) for ref in REFERENCES for k in ("final_sampled", "greedy")]
    head = [f"minus {REFERENCES[ref]}, {'sampled' if k == 'final_sampled' else 'greedy'}" for ref, k in cols]
    ns = [p["n"] for ref in vs.values() for by in ref.values() for p in by.values()]
    seeds = max(set(ns), key=ns.count)
    n_text = f"n = {seeds} seed{'s' * (seeds != 1)}"
    lines = [
        f"Pooled over K = {lags}, the seed as the unit (each seed's paired differences averaged within a lag "
        f"first, then over these lags; the 95 % t interval is over seeds, {n_text} unless marked; pairs in "
        "parentheses): mean [95 % t CI]; bold: outside the noise, italics: inside it",
        "",
        "| | " + " | ".join(head) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for g in groups:
        lines.append(f"| {g} | " + " | ".join(entry(vs[ref][k].get(g), seeds) for ref, k in cols) + " |")
    amb = result["arm_minus_arm"]
    refs = [b for b in ARMS if any(amb[k][b] for k in amb)]
    rows = [g for g in groups if any(g in amb[k][b] for k in amb for b in refs)]
    if not refs:
        return "\n".join(lines)
    extra = [g for g in rows if g not in ARMS]
    note = (
        f"; rows with other overrides ({', '.join(extra)}) against the column's arm with the same overrides"
        if extra
        else ""
    )
    lines += [
        "",
        f"Arm (row) minus arm (column) at the same K, pooled over K = {lags}, the seed as the unit ({n_text} "
        f"unless marked): sampled (pairs) / greedy{note}",
        "",
        "| | " + " | ".join(refs) + " |",
        "|---" * (len(refs) + 1) + "|",
    ]
    for a in rows:
        row = []
        for b in refs:
            s, g = amb["final_sampled"][b].get(a), amb["greedy"][b].get(a)
            row.append(f"{entry(s, seeds)} / {value_text(g)}" if s else "")
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    return "\n".join(lines)
