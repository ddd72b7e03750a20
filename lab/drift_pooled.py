"""The drift grid's comparisons pooled over several lags, with the seed as the unit.

    python -m lab.drift_grid --analyze outputs/bench/lag_mb4 --lags 0 1 2 4 8 --pool-lags 2 4 8 --markdown \\
        --store lab/results/lag_grid_mb4_5e-4_b2.jsonl --with-store lab/results/lag_grid_mb4_5e-4.jsonl \\
        -- algo.minibatches=4 module.optimizer.lr=5e-4

(reads the stores only, seconds of CPU). For each arm, its runs at the lags in ``--pool-lags``
are paired with a reference (``lab.drift_table.paired_runs``: its own K = 0 run, bypass's K = 0
run, or another arm at the same K; by seed within a build of the warm start); the differences
of one seed are averaged first, then the mean and 95 % t interval are taken over seeds
(``bench_metrics.per_seed_ci``: n = seeds, df = n - 1). Pooling the (K, seed) pairs as
independent values instead would count one seed's shared prompts, and the one K = 0 run that
every lag of a seed subtracts, three or four times over (``per_seed_ci``'s docstring).
"""

from __future__ import annotations

import re

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
    ``lags``, the seed as the unit (``seed_ci``); ``reference_n`` counts pairs taken against
    plain decoupled's K = 0 run (``paired_runs``'s fallback)."""
    groups: dict[str, dict] = {}
    for spec, p in paired_runs(cells, reference, key).items():
        if lag_of(spec) not in lags:
            continue
        g = groups.setdefault(group_of(spec), {"pairs": [], "via_alt": 0})
        g["pairs"] += p["pairs"]
        g["via_alt"] += p["via_alt"]
    out = {}
    for name, g in groups.items():
        out[name] = seed_ci(g["pairs"])
        if g["via_alt"]:
            out[name].update(reference="decoupled", reference_n=g["via_alt"])
    return out


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


def entry(p: dict | None, seeds: int | None = None) -> str:
    """``ci_text`` with the counts: '+0.005 [-0.009, +0.018] (9 pairs)', the seeds named too
    where they are not ``seeds`` (the table's common n): '(2 seeds, 5 pairs)'."""
    text = ci_text(p)
    if not p:
        return text
    n = "" if p["n"] == seeds else f"{p['n']} seed{'s' * (p['n'] != 1)}, "
    counts = f"({n}{p['n_pairs']} pairs)"
    return f"{text} {counts}" if text else f"{p['mean']:+.3f} {counts}"


def markdown(result: dict) -> str:
    """The pooled comparisons as two Markdown tables: each group against the references
    (sampled, greedy), and arm minus arm at the same K (sampled / greedy)."""
    lags = " / ".join(str(k) for k in result["lags"])
    vs = result["vs"]
    groups = list(dict.fromkeys(g for ref in vs.values() for by in ref.values() for g in by))
    cols = [(ref, k) for ref in REFERENCES for k in ("final_sampled", "greedy")]
    head = [f"minus {REFERENCES[ref]}, {'sampled' if k == 'final_sampled' else 'greedy'}" for ref, k in cols]
    ns = [p["n"] for ref in vs.values() for by in ref.values() for p in by.values()]
    seeds = max(set(ns), key=ns.count) if ns else None
    lines = [
        f"Pooled over K = {lags}, the seed as the unit (each seed's paired differences at these lags averaged "
        f"first; the 95 % t interval is over seeds, n = {seeds} seeds unless marked; pairs in parentheses): "
        "mean [95 % t CI]; bold: outside the noise, italics: inside it",
        "",
        "| | " + " | ".join(head) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for g in groups:
        lines.append(f"| {g} | " + " | ".join(entry(vs[ref][k].get(g), seeds) for ref, k in cols) + " |")
    amb = result["arm_minus_arm"]
    arms = [a for a in ARMS if any(a in amb[k][b] for k in amb for b in amb[k])]
    refs = [b for b in ARMS if any(amb[k][b] for k in amb)]
    lines += [
        "",
        f"Arm (row) minus arm (column) at the same K, pooled over K = {lags}, the seed as the unit (n = {seeds} "
        "seeds unless marked): sampled (pairs) / greedy",
        "",
        "| | " + " | ".join(refs) + " |",
        "|---" * (len(refs) + 1) + "|",
    ]
    for a in arms:
        row = []
        for b in refs:
            s, g = amb["final_sampled"][b].get(a), amb["greedy"][b].get(a)
            row.append(f"{entry(s, seeds)} / {ci_text(g)}" if s else "")
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    return "\n".join(lines)
