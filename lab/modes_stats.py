"""The rollout-mode benchmark's statistics: per-seed records -> per-recipe summaries, time to the
reference's reward, ratios to the bound and to the reference, and the intervals a claim rests on.

Imported by ``lab.modes`` (run that: ``python -m lab.modes ...``, or ``--from-log`` to rebuild
from a log); the figures are defined in its docstring. Pure: no files, no processes.
"""

from __future__ import annotations

import math
import statistics

from lab.bench_metrics import (
    bootstrap_ci,
    mean_ci,
    mean_curve_held,
    ratio_ci,
    reward_at,
    summarize_times,
    target_from_finals,
    time_to_reward,
    welch_diff_ci,
)


def summarize(values: list[float]) -> dict[str, float]:
    """Mean, std, min, max over seeds; NaN (a figure a run does not have, e.g. the TRL peer's
    engine idle fraction) everywhere when every value is NaN."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return {"mean": float("nan"), "std": float("nan"), "min": float("nan"), "max": float("nan")}
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def aggregate(per_seed: list[dict]) -> dict:
    keys = [
        "eval_before",
        "eval_after",
        "sampled_eval_before",
        "sampled_eval_after",
        "samples_per_s",
        "tokens_per_s",
        "trainer_idle_frac",
        "engine_idle_frac",
        "weight_sync_s_mean",
        "wall_s",
        "train_wall_s",
        "train_reward_first10",
        "train_reward_last10",
        "staleness_mean",
        "staleness_max",
        "dropped_groups",
        "response_len_mean",
        "len_kl_trained_vs_issued",
        "level_kl_trained_vs_issued",
        "staleness_long_minus_short",
        "trained_frac_level2",
        "staleness_frac_0",
        "staleness_frac_1",
        "staleness_frac_2",
        "staleness_frac_3plus",
    ]
    return {
        **{k: summarize([s[k] for s in per_seed]) for k in keys},
        "eval_gain_per_seed": [s["eval_after"] - s["eval_before"] for s in per_seed],
        "weight_sync_max_abs_diff": max(s["weight_sync_max_abs_diff_max"] for s in per_seed),
    }


CURVE_KEYS = ("sampled", "greedy")  # primary, secondary


def add_comparisons(
    result: dict,
    all_runs: dict[str, list[dict]],
    reference: str,
    bounds: dict[str, dict],
    bound_of: dict[str, str],
) -> None:
    """Time to the reference's final reward, ratios to the bound and to the reference."""
    ref_runs = all_runs.get(reference)
    ref_rate = statistics.fmean(s["samples_per_s"] for s in ref_runs) if ref_runs else None
    targets: dict[str, float] = {}
    if ref_runs and all("curve" in s for s in ref_runs):
        for name in CURVE_KEYS:
            finals = [s["curve"][-1][name] for s in ref_runs if s["curve"]]
            if any(not math.isnan(v) for v in finals):
                targets[name] = target_from_finals(finals)
                # A softer target, less at the mercy of the last evaluation's noise: 90 % of
                # the reference's mean gain over the starting policy.
                start = target_from_finals([s["curve"][0][name] for s in ref_runs if s["curve"]])
                targets[name + "_90pct_gain"] = start + 0.9 * (targets[name] - start)
        result["time_to_reward_target"] = {
            **targets,
            "reference": reference,
            "definition": "mean over the reference seeds of their final post-hoc held-out reward; "
            "*_90pct_gain: start + 0.9 (that - start)",
        }
    elif all_runs and any("curve" in s for runs in all_runs.values() for s in runs):
        result["time_to_reward_target"] = {"reference": reference, "note": "reference recipe not run"}
    for spec, runs in all_runs.items():
        agg = result["recipes"][spec]
        if ref_rate:
            agg["ratio_to_sync"] = summarize([s["samples_per_s"] / ref_rate for s in runs])
        if spec in bound_of:
            b = bounds[bound_of[spec]]
            agg["bound"] = {
                "measured_as": bound_of[spec],
                "samples_per_s": b["bound_samples_per_s"],
                "limited_by": b["limited_by"],
                "generation_samples_per_s": b["generation"]["samples_per_s"],
                "training_samples_per_s": b["training"]["samples_per_s"],
                "bound_with_sync_samples_per_s": b["bound_with_sync_samples_per_s"],
                # The bound trains the issued (unbiased) mix of responses. A mode that trains a
                # shorter mix (dropping stale long groups) has cheaper steps and can exceed it:
                # compare with this recipe's response_len_mean.
                "trained_response_len_mean": b["training"]["response_len_mean"],
            }
            agg["ratio_to_bound"] = summarize([s["samples_per_s"] / b["bound_samples_per_s"] for s in runs])
            if b.get("shared_estimate_samples_per_s"):  # tools.bound --shared
                agg["bound"]["shared"] = b["shared"]
                shared = b["shared_estimate_samples_per_s"]
                agg["ratio_to_shared_estimate"] = summarize([s["samples_per_s"] / shared for s in runs])
        if targets and all("curve" in s for s in runs):
            ttr = {}
            for name, target in targets.items():
                for interpolate, suffix in ((True, ""), (False, "_first_eval")):
                    ttr[name + suffix] = summarize_times(
                        [
                            time_to_reward(
                                [p["train_wall_s"] for p in s["curve"]],
                                [p[name.split("_90pct")[0]] for p in s["curve"]],
                                target,
                                interpolate,
                            )
                            for s in runs
                        ]
                    )
                # one number per mode: where the seed-mean curve (ended runs keep their final
                # reward) crosses the target
                grid, mean = mean_curve_held(
                    [
                        (
                            [p["train_wall_s"] for p in s["curve"]],
                            [p[name.split("_90pct")[0]] for p in s["curve"]],
                        )
                        for s in runs
                    ]
                )
                ttr[name + "_seed_mean_curve"] = time_to_reward(grid, mean, target, True)
            ttr["train_wall_s_per_seed"] = [s["train_wall_s"] for s in runs]
            agg["time_to_reward_s"] = ttr
    if targets and ref_runs:
        add_power(result, all_runs, reference, targets)


FINAL_KEYS = ("eval/sampled_reward_mean", "eval/reward_mean", "eval/sampled_exact_mean", "eval/exact_mean")
FINAL_PREFIXES = ("eval/sampled_", "eval/exact_", "eval/reward_level")
EQUAL_WALL_FRACTIONS = (0.25, 0.4, 0.5, 1.0)


def add_power(result: dict, all_runs: dict[str, list[dict]], reference: str, targets: dict) -> None:
    """The comparisons a claim rests on, each with a 95 % interval over seeds (``power`` per
    recipe):

    * ``final``: final held-out figures (overall, per level, exact match): mean, t interval;
    * ``final_minus_reference``: the sampled-reward difference to the reference, Welch t
      interval (independent seeds);
    * ``time_to_90pct_gain_s``: training wall time until the sampled reward reaches the start
      plus 90 % of the reference's mean gain (interpolated), mean and t interval over the seeds
      that reached it (``n`` of ``n_total``);
    * ``time_ratio_to_reference``: that time over the reference's, ratio of means with a
      delta-method t interval on its log (``lo``/``hi``) and a percentile bootstrap
      (``bootstrap``, narrower with few seeds: it has no t correction). Intervals only when
      every seed of both reached the target (``all_reached``): leaving out the seeds that never
      got there would judge a recipe by its fastest seeds;
    * ``reward_at_equal_wall``: the sampled reward each run's policy has at fractions of the
      reference's mean training wall time (a run that has ended keeps its final policy).
    """
    ref_runs = all_runs[reference]
    target = targets.get("sampled_90pct_gain")
    ref_wall = statistics.fmean(s["train_wall_s"] for s in ref_runs)

    def times(runs: list[dict]) -> list[float | None]:
        return [
            time_to_reward(
                [p["train_wall_s"] for p in s["curve"]], [p["sampled"] for p in s["curve"]], target, True
            )
            for s in runs
        ]

    ref_all = times(ref_runs) if target is not None else []
    ref_times = [t for t in ref_all if t is not None]
    ref_final = [s["curve"][-1]["sampled"] for s in ref_runs]
    for spec, runs in all_runs.items():
        if not all(s.get("curve") for s in runs):
            continue
        last_keys = sorted(
            {
                k
                for s in runs
                for k in s.get("curve_last", {})
                if k in FINAL_KEYS or k.startswith(FINAL_PREFIXES)
            }
        )
        power: dict = {
            "final": {k: mean_ci([s.get("curve_last", {}).get(k) for s in runs]) for k in last_keys},
            "start": {k: mean_ci([s.get("curve_first", {}).get(k) for s in runs]) for k in last_keys},
            "final_minus_reference": welch_diff_ci([s["curve"][-1]["sampled"] for s in runs], ref_final),
            "train_wall_s": mean_ci([s["train_wall_s"] for s in runs]),
            "reward_at_equal_wall": {
                f"{frac:g}x_reference_wall": {
                    "t_s": frac * ref_wall,
                    **mean_ci(
                        [
                            reward_at(
                                [p["train_wall_s"] for p in s["curve"]],
                                [p["sampled"] for p in s["curve"]],
                                frac * ref_wall,
                            )
                            for s in runs
                        ]
                    ),
                }
                for frac in EQUAL_WALL_FRACTIONS
            },
        }
        if target is not None:
            mine = times(runs)
            reached = [t for t in mine if t is not None]
            power["time_to_90pct_gain_s"] = {"target": target, **mean_ci(mine)}
            all_reached = len(reached) == len(mine) and len(ref_times) == len(ref_all)
            ratio = ratio_ci(reached, ref_times)
            power["time_ratio_to_reference"] = {
                "n": len(reached),
                "n_total": len(mine),
                "all_reached": all_reached,
                "value": ratio["value"],
                "lo": ratio["lo"] if all_reached else None,
                "hi": ratio["hi"] if all_reached else None,
                "bootstrap": bootstrap_ci(reached, ref_times, "ratio") if all_reached else None,
            }
        result["recipes"][spec]["power"] = power
