"""``lab.detector_eval``'s result as Markdown: each candidate on the fit seeds, the held-out
seeds, the lag-0 runs and the stores never fitted on; then the grid's best points.

Imported by ``lab.detector_eval`` (run that: ``python -m lab.detector_eval --markdown``).
"""

from __future__ import annotations


def cell(s: dict) -> str:
    med, sharp = ("-" if x is None else f"{x:g}" for x in (s["median_lead"], s["median_lead_sharp"]))
    return f"{s['false_alarms']}/{s['healthy']} | {s['missed']}/{s['collapsed']} | {s['timely']} | {med} | {sharp}"


def describe(config: dict) -> str:
    if "signals" in config:
        knobs = ", ".join(
            f"{k} {config[k]}"
            for k in ("threshold", "patience", "alpha", "warmup", "baseline")
            if k in config
        )
        return f"{'+'.join(config['signals']) or '-'}; nets {config['net']}; {knobs}"
    return ", ".join(f"{k} {v}" for k, v in config.items())


def markdown(result: dict) -> str:
    head = "| false alarms / healthy | missed / dated collapses | alarmed >= 10 ahead | median lead | sharp"
    lines = [
        f"{result['store']}, lagged runs: fit seeds {result['fit_seeds']}, held-out seeds"
        f" {result['held_out_seeds']}; never fitted: their lag-0 runs and {', '.join(result['extra']) or '-'}"
        " (all seeds).",
        "",
        f"| candidate {head} (fit) {head} (held out) | K=0 false alarms / healthy, missed / dated collapses"
        " | never fitted: false alarms / healthy, missed / dated collapses | goal met held out |",
        "|---" * 14 + "|",
    ]
    for name, c in result["candidates"].items():
        met = "yes" if c["goal_met_held_out"] else "no"
        zero, extra = (
            f"{b['false_alarms']}/{b['healthy']}, {b['missed']}/{b['collapsed']}"
            for b in (c["lag0"], c["extra"])
        )
        lines.append(f"| {name} | {cell(c['fit'])} | {cell(c['held_out'])} | {zero} | {extra} | {met} |")
    lines += ["", "Configurations:", ""]
    lines += [f"* {name}: {describe(c['config'])}" for name, c in result["candidates"].items()]
    for name in ("vcpo", "selective"):
        if not result["candidates"][name]["met_goal_on_fit"]:
            lines.append(
                f"  (no {name} setting met the goal on the fit seeds: the fewest false alarms shown)"
            )
    lines.append(
        "  (default: chosen on seed 1 of drift_grid_3e-3; it holds out every other store and that"
        " store's other folds do not hold it out)"
    )
    g = result["grid"]
    variants = ", ".join(f"{v} (min_scale {s['min_scale']:g})" for v, s in g["variants"].items())
    lines += [
        "",
        f"Selective grid: any subset of {variants} (at most one of each signal); nets {g['nets']};"
        f" {g['knobs']}; VCPO: {g['vcpo']}.",
        "",
        f"{g['size']} points, {g['meet_goal_on_fit']} meet the goal on the fit seeds; the best:",
        "",
        f"| configuration {head} (fit) {head} (held out) |",
        "|---" * 11 + "|",
    ]
    lines += [f"| {describe(t['config'])} | {cell(t['fit'])} | {cell(t['held_out'])} |" for t in g["top"]]
    if not g["top"]:
        lines.append(
            "| none meets the goal on the fit seeds (the selective row above: the fallback) |" + " |" * 10
        )
    d = result["candidates"]["default"]
    lines += [
        "",
        "Collapses dated at the earliest step the slide rule can give (the reward EMA below its reference"
        " when the window closed; no alarm can lead such a date):"
        f" fit {d['fit']['dated_at_earliest']} of {d['fit']['collapsed']}, held out"
        f" {d['held_out']['dated_at_earliest']} of {d['held_out']['collapsed']}; undated: fit"
        f" {d['fit']['undated']}, held out {d['held_out']['undated']}",
    ]
    if result["margin"]:
        lines += [
            "",
            f"Marginal runs (final within {result['margin']:g} below the warm start; not scored): fit"
            f" {d['fit']['marginal']}, held out {d['held_out']['marginal']}, K = 0 {d['lag0']['marginal']},"
            f" never fitted {d['extra']['marginal']}",
        ]
    blind = result["ess_blind_collapses"]
    lines += ["", f"Collapses in bypass runs (ESS fraction always 1, invisible to ESS rules): {blind}"]
    return "\n".join(lines)
