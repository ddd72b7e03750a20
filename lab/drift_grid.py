"""Estimator drift on the real engine: lag K x correction, the bf16 mismatch, detector lead time.

    python -m lab.drift_grid                                     # K x correction grid, 3 seeds
    python -m lab.drift_grid --lags 0 4 --corrections none tis --seeds 0 -- trainer.max_steps=30
    python -m lab.drift_grid --mismatch                          # bf16 engine, float32 trainer
    python -m lab.drift_grid --controller                        # + callbacks/drift=controller
    python -m lab.drift_grid --analyze outputs/bench/drift       # re-read finished runs
    python -m lab.drift_grid --analyze outputs/bench/drift --pool-lags 2 4 8   # + pooled over K, per seed
    python -m lab.drift_grid --resume --out outputs/bench/drift  # finish an interrupted grid
    python -m lab.drift_grid --resume --store lab/results/drift_grid_3e-3.jsonl ...  # across sessions
    python -m lab.drift_grid --replay outputs/bench/modes5/*/seed*   # the detector on any runs

Each cell is ``sync_grpo`` with a delayed weight sync (``callbacks.weight_sync.lag=K``: every
trained token exactly K versions old) and a correction: ``none`` keeps the bypass anchor (pi_old
:= mu, the PPO ratio against the behaviour policy, as the shipped recipes do); every other
correction runs with the decoupled anchor, so it sees pi_old / mu. Every run carries the drift
monitor (``callbacks/drift=monitor``: no actions), so the detector's alarms and its inputs are
in each run's metrics.csv; ``--analyze`` replays ``modules.callbacks.drift_score.DriftDetector`` offline on
them (other thresholds can be tried without training again).

Definitions (per run):
* collapse: the held-out sampled reward of the final policy is below the warm start's, or the
  run stopped on non-finite losses; the collapse *step* is, where the held-out curve was
  evaluated between the run's ends (``--eval-every`` a few versions), the first evaluated step
  from which that reward stays more than ``HELDOUT_MARGIN`` (0.05) below the warm start's
  (``heldout``; dated at the training step whose update made those weights; a run ending
  closer to the start has no date there); otherwise the first step at
  which the training reward's EMA (``train/reward_ema``) falls ``--drop`` below its running
  maximum, or, for a slow slide that never drops that far, the first step from which the EMA
  stays below the mean training reward of the first 10 steps (``collapse_rule`` says which
  dated it: ``heldout``, then ``drop``, then ``stopped`` for a run that ended on non-finite
  losses, then ``below_start``);
* lead time: collapse step minus the first alarm step (positive: the alarm came first);
* false alarm: an alarm in a run that did not collapse and that no controller acted on (a
  controlled run that did not collapse after acting on an alarm is counted as ``acted``).

Runs are ``lab.modes`` runs (same post-hoc held-out curve); writes ``result.json`` with
the K x correction table (final reward mean and spread over seeds, collapse yes/no and step)
and the detector's lead times and false alarms.

This file is the command line; the work is in ``lab.drift_cells`` (arms, cell specs),
``lab.drift_outcome`` (one run's metrics -> collapse, alarm, diagnostics), ``lab.drift_store``
(run directories and the run store), ``lab.drift_table`` (outcomes -> the table, paired
differences, the seed as the unit), ``lab.drift_pooled`` (differences pooled over lags, averaged
within seed first) and ``lab.drift_report`` (the table as Markdown, the trajectories plot).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lab import run_store
from lab.drift_cells import ARMS, MISMATCH, cell_spec, short
from lab.drift_outcome import replay
from lab.drift_pooled import lags_to_pool, pooled
from lab.drift_pooled import markdown as pooled_markdown
from lab.drift_report import markdown, plot_trajectories
from lab.drift_store import archive, check_setup, find_run, pending_seeds, run_lock, start_reward, sweep
from lab.drift_table import table
from lab.modes_run import read_metrics, run_recipe

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    parser.add_argument(
        "--arms", "--corrections", nargs="+", default=None, help=f"default {' '.join(ARMS)} (see ARMS)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--mismatch", action="store_true", help="bf16 engine at lag 0 instead of the grid")
    parser.add_argument("--controller", action="store_true", help="add callbacks/drift=controller")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--drop", type=float, default=0.15, help="reward-EMA drop that dates a collapse")
    parser.add_argument("--threshold", type=float, help="the detector's alarm threshold (default: its own)")
    parser.add_argument("--patience", type=int, help="steps over the threshold (default: the detector's)")
    parser.add_argument("--analyze", type=Path, help="only re-read the runs under this directory")
    parser.add_argument(
        "--replay", type=Path, nargs="+", help="only replay the detector on these finished runs (lag 0)"
    )
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown, not JSON")
    parser.add_argument(
        "--pool-lags",
        type=int,
        nargs="+",
        help="also pool each arm's paired differences over these lags, the seed as the unit "
        "(lab.drift_pooled; default: every lag > 0 of the cells; lags no cell has are ignored)",
    )
    parser.add_argument(
        "--with-store",
        type=Path,
        nargs="+",
        default=[],
        help="read-only stores of other builds of the warm start, read beside --store (paired "
        "only within a build; never resumed nor appended to)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="skip the cells' seeds finished under --out or held by --store, rerun the rest",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "drift")
    parser.add_argument(
        "--store",
        type=Path,
        help="a committed JSONL of finished runs (lab/run_store.py): appended to as runs "
        "finish, skipped by --resume, read by --analyze with the run directories",
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    args = parser.parse_args()
    ctl = args.controller
    if args.mismatch:
        specs = [cell_spec(0, c, ["engine.dtype=bfloat16"], ctl) for c in args.arms or MISMATCH]
    else:
        specs = [cell_spec(k, c, None, ctl) for k in args.lags for c in args.arms or ARMS]
    if args.replay:  # false alarms on runs of any recipe (their metrics.csv)
        detector = {
            k: v for k, v in (("threshold", args.threshold), ("patience", args.patience)) if v is not None
        }
        runs = [r for r in args.replay if (r / "metrics.csv").exists()]
        alarms = {str(r): replay(read_metrics(r), 0, **detector) for r in runs}
        fired = {k: v for k, v in alarms.items() if v is not None}
        print(json.dumps({"runs": len(alarms), "alarmed": len(fired), "first_alarm": fired}))
        return
    out = args.analyze or args.out
    for path in args.with_store:  # read-only: a typo would silently read nothing
        if not path.exists():
            parser.error(f"--with-store {path}: no such file")
    paths = [p.resolve() for p in args.with_store] + ([args.store.resolve()] if args.store else [])
    if len(set(paths)) < len(paths):
        parser.error("--with-store names a store twice, or the --store itself: its runs would count twice")
    others = [run_store.load(p) for p in args.with_store]
    for other in others:  # another build of the same experiment, not another experiment
        check_setup(other, specs, {"overrides": args.overrides, "eval_every": args.eval_every})
    stored = run_store.load(args.store) if args.store else None
    if stored is not None:
        if not args.eval_every:
            parser.error("--store needs --eval-every > 0 (a run is stored once its held-out curve exists)")
        setup = {"overrides": args.overrides, "eval_every": args.eval_every, "commit": run_store.commit()}
        check_setup(stored, specs, setup)
        sweep(out, specs, args.seeds, args.store, stored, setup)
    if not args.analyze:
        for spec in specs:
            for seed in args.seeds:  # one at a time: each run is stored as soon as it ends
                with run_lock(out, spec, seed) as mine:
                    # another worker has it, or (decided under the lock) it is already done
                    if not mine or (args.resume and not pending_seeds(out, spec, [seed], stored)):
                        continue
                    results = run_recipe(
                        spec,
                        [seed],
                        out,
                        args.overrides,
                        args.eval_every,
                        prune_checkpoints=True,
                        keep_going=True,
                    )
                    if stored is not None:
                        archive(out, spec, results, args.store, stored, setup)
    detector = {
        k: v for k, v in (("threshold", args.threshold), ("patience", args.patience)) if v is not None
    }
    result = table(out, specs, args.seeds, args.drop, detector, stored, others)
    result["pooled"] = pooled(result["cells"], lags_to_pool(specs, args.pool_lags))
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    runs = {}
    for spec in specs:
        for seed in args.seeds:
            found = find_run(out, spec, seed, stored)
            if found is not None:
                runs[f"{short(spec)} s{seed}"] = found[0]
    if runs:
        plot_trajectories(runs, out / "trajectories.png")
    if args.markdown:
        pooled_text = pooled_markdown(result["pooled"])  # empty without lagged pairs
        print(
            markdown(result["cells"], start_reward(out, stored))
            + (f"\n\n{pooled_text}" if pooled_text else "")
        )
    else:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
