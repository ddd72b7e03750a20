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

This file is the command line; the work is in ``lab.modes_run`` (train a spec per seed, its
held-out curve, its per-seed record; the bound), ``lab.modes_stats`` (records -> summaries,
time to reward, intervals) and ``lab.modes_plots`` (the two plots).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lab.modes_plots import plot, plot_reward_vs_wall
from lab.modes_run import TRL, measure_bounds, retime, run_dir_name, run_recipe, split_spec
from lab.modes_stats import add_comparisons, aggregate

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPES = [
    "sync_grpo",
    "partial_grpo",
    "async_grpo",  # regenerate at K = 4: the bound holds
    # streaming with admission control (AReaL-style: nothing dropped, the trainer may wait)
    "async_grpo:rollout/staleness=admit",
    # streaming with K = 2 as a target (async_grpo's default until 2026-12-07)
    "async_grpo:rollout/staleness=throttle,rollout.max_staleness=2",
    # does stratified selection give back what dropping long groups costs the long level?
    "async_grpo:rollout/selection=stratified",
]


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
    parser.add_argument(
        "--retime",
        help="with --from-log: redo each record's training clock from its run directory under "
        "this folder (RETIME/<spec>/seed<n>/metrics.csv; tools.heldout_curve's end-of-step clock)",
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
        if args.retime:
            all_runs = {
                spec: [retime(r, Path(args.retime) / run_dir_name(spec) / f"seed{r['seed']}") for r in runs]
                for spec, runs in all_runs.items()
            }
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
    if not bounds:  # a --no-bound sitting: nothing to match, and its specs need not compose today
        return bounds, {}, runs
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


if __name__ == "__main__":
    main()
