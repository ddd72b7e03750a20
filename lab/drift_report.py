"""The drift grid's table as Markdown, and its runs' trajectories as a plot.

Imported by ``lab.drift_grid`` (run that: ``python -m lab.drift_grid --analyze ... --markdown``):
a ``lab.drift_table.table`` result's cells -> Markdown tables; metrics rows ->
``trajectories.png``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from lab.drift_cells import ARMS, CORRECTIONS, MISMATCH, arm_of, spec_overrides
from modules.callbacks.drift_score import DriftDetector


def reward_text(cell: dict) -> str:
    """One cell of the reward table: mean +- sd (n evaluated), greedy, stopped runs, collapses."""
    n = cell["n"] - cell["unevaluated"]
    text = f"{cell['final_sampled_mean']:.3f} +- {cell['final_sampled_std']:.3f} ({n})" if n else "-"
    if n and math.isfinite(cell.get("greedy_mean", math.nan)):
        text += f" / {cell['greedy_mean']:.3f}"
    if cell["unevaluated"]:
        text += f", {cell['unevaluated']} stopped"
    if cell["collapsed"]:
        steps = "/".join(str(x) for x in cell["collapse_steps"] if x is not None)
        text += f", **{cell['collapsed']} collapsed**" + (f" @{steps}" if steps else "")
    if cell.get("other_build"):
        text += f" ({cell['other_build']} of another build)"
    return text


def diagnostics_text(cell: dict) -> str:
    d = defaultdict(lambda: math.nan, cell["diagnostics"])
    return f"{d['is/ess_frac']:.2f} / {d['train/kl_behavior']:.3f} / {d['train/clip_frac']:.2f}"


def anchors_text(cell: dict) -> str:
    d = defaultdict(lambda: math.nan, cell["diagnostics"])
    return (
        f"{d['ratio/mu_out_frac']:.2f} / {d['ratio/pi_old_out_frac']:.2f} / {d['ratio/mu_max']:.1f} / "
        f"{d['is/weight_max']:.1f}"
    )


def ci_text(p: dict | None) -> str:
    """mean [95 % CI], in italics when the interval holds 0, bold when it does not."""
    if not p or p["ci"] is None:
        return ""
    text = f"{p['mean']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}]"
    text = f"*{text}*" if p["inside_noise"] else f"**{text}**"
    if not p.get("reference"):
        return text
    pairs = p.get("n_pairs", p["n"])
    some = "" if p.get("reference_n", pairs) == pairs else f" for {p['reference_n']} of {pairs} pairs"
    return f"{text} (vs {p['reference']}{some})"


def paired_text(cell: dict) -> str:
    """The paired difference to K = 0 (sampled)."""
    return ci_text(cell.get("vs_k0"))


def greedy_paired_text(cell: dict) -> str:
    return ci_text(cell.get("greedy_vs_k0"))


def bypass_text(cell: dict) -> str:
    """The paired difference to ``bypass`` at the same K: sampled / greedy."""
    s, g = ci_text(cell.get("vs_bypass")), ci_text(cell.get("greedy_vs_bypass"))
    return f"{s} / {g}" if s else ""


def decoupled_text(cell: dict) -> str:
    """The paired difference to plain ``decoupled`` at the same K: sampled / greedy."""
    s, g = ci_text(cell.get("vs_decoupled")), ci_text(cell.get("greedy_vs_decoupled"))
    return f"{s} / {g}" if s else ""


def markdown(cells: dict[str, dict], start: float) -> str:
    """The lag x correction table of a ``table`` result as Markdown: final held-out sampled
    reward (mean +- sd over seeds, n), collapses (count and dated steps); then the estimator's
    diagnostics per cell (means over seeds of the per-run medians at full lag)."""
    grid: dict[tuple[str, str], dict] = {}
    for spec, cell in cells.items():
        parts = spec_overrides(spec)
        row = f"K = {parts.get('callbacks.weight_sync.lag', '0')}"
        row += " (bf16 engine)" if parts.get("engine.dtype") == "bfloat16" else ""
        row += " + controller" if parts.get("callbacks/drift") == "controller" else ""
        grid[(row, arm_of(spec))] = cell
    rows = list(dict.fromkeys(r for r, _ in grid))
    used = {c for _, c in grid}
    cols = [c for c in dict.fromkeys([*ARMS, *CORRECTIONS, *MISMATCH, *sorted(used)]) if c in used]
    titles = {
        reward_text: "Final held-out sampled reward, mean +- sd (n runs) / greedy mean; collapsed = final below the "
        f"warm start ({start:.3f})",
        diagnostics_text: "Diagnostics at full lag (medians per run, mean over seeds): ESS fraction / "
        "behaviour KL / clip fraction",
        paired_text: "Final held-out sampled reward minus K = 0's, same arm (or plain `decoupled`'s where marked), "
        "paired by seed within a build, the seed as the unit (a seed's pairs averaged first): mean [95 % t CI over "
        "seeds]; italics: inside the noise (the interval holds 0)",
        greedy_paired_text: "The same for the greedy held-out reward (minus K = 0's, same arm or where marked plain "
        "`decoupled`'s, paired by seed within a build, the seed as the unit)",
        bypass_text: "Final held-out reward minus `bypass`'s at the same K, paired by seed within a build, the seed as "
        "the unit: sampled / greedy, mean [95 % t CI over seeds]; italics: inside the noise",
        decoupled_text: "The correction alone: final held-out reward minus plain `decoupled`'s at the same K, "
        "paired by seed within a build, the seed as the unit: sampled / greedy; italics: inside the noise",
        anchors_text: "Both anchors at full lag: share of tokens with pi / mu outside 1 -+ 0.2 / the same "
        "for pi / pi_old (medians per run, mean over seeds) / largest pi / mu / largest IS weight",
    }
    lines: list[str] = []
    for fmt, title in titles.items():
        lines += ["", title, "", "| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for row in rows:
            out = [fmt(grid[(row, col)]) if (row, col) in grid else "" for col in cols]
            lines.append(f"| {row} | " + " | ".join(out) + " |")
    if any(c.get("other_build") for c in cells.values()):
        lines += [
            "",
            "(n of another build): n of the cell's runs began from another build of the warm start "
            "(a store read with --with-store); each is judged against its own build's start and "
            "paired only with runs of its build.",
        ]
    return "\n".join(lines[1:])


TRAJECTORY_KEYS = ("train/reward_ema", "train/kl_behavior", "train/clip_frac", "drift/score")


def plot_trajectories(runs: dict[str, list[dict[str, str]]], path: Path) -> None:
    """One line per run (label -> metrics rows) for each diagnostic over training steps (log
    scale for the KL)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TRAJECTORY_KEYS), figsize=(4.2 * len(TRAJECTORY_KEYS), 3.6))
    for label, rows in runs.items():
        rows = [r for r in rows if r.get("step") and r.get("train/loss")]
        for ax, key in zip(axes, TRAJECTORY_KEYS):
            pts = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
            ax.plot([p[0] for p in pts], [max(p[1], 1e-6) for p in pts], label=label, lw=1)
    for ax, key in zip(axes, TRAJECTORY_KEYS):
        ax.set_title(key)
        ax.set_xlabel("optimizer step")
        if key == "train/kl_behavior":
            ax.set_yscale("log")
            ax.axhline(0.2, color="k", ls=":", lw=0.8)  # the detector's ceiling
        if key == "drift/score":
            ax.axhline(DriftDetector().threshold, color="k", ls=":", lw=0.8)  # the default alarm threshold
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=7)
    fig.tight_layout(rect=(0, 0.06 + 0.03 * (len(labels) // 4), 1, 1))
    fig.savefig(path, dpi=100)
