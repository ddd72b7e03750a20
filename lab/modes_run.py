"""Running one recipe spec of the rollout-mode benchmark: train it once per seed (``train.py``, or
the TRL peer in its venv), evaluate its held-out curve after the run, read its metrics back
into one record per seed; and measure the recipes' bound (``tools.bound``).

Imported by ``lab.modes`` (run that: ``python -m lab.modes ...``) and ``lab.drift_grid``;
``read_metrics`` / ``run_dir_name`` by the other readers of those runs. A spec is
``recipe`` or ``recipe:override,override`` (``split_spec``); each seed's run directory is
``<out>/<run_dir_name(spec)>/seed<N>``.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def last(rows: list[dict[str, str]], key: str) -> float:
    vals = [float(r[key]) for r in rows if r.get(key)]
    return vals[-1]


def mean_of(rows: list[dict[str, str]], key: str, skip: int = 0) -> float:
    vals = [float(r[key]) for r in rows if r.get(key)][skip:]
    return sum(vals) / len(vals)


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
        from tools.trl_peer import peer_recipe

        k = eval_every * steps_per_version(
            peer_recipe(overrides) if recipe == TRL else [f"recipe={recipe}", *overrides]
        )
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
                # training clock: seconds from the first training step to the last one's end
                "train_wall_s": end_of_training(run_dir),
                **curve_fields(curve),
            }
        )
        print(json.dumps({"recipe": spec, **per_seed[-1]}), file=sys.stderr)
    return per_seed


def end_of_training(run_dir: Path) -> float:
    """Seconds from the first training step's start to the last one's end (``wall_at_steps``)."""
    from tools.heldout_curve import wall_at_steps

    return last_end(wall_at_steps(run_dir))


def last_end(logged: dict[int, dict[str, float]]) -> float:
    """The last logged step's end (``wall_at_steps``'s clock); NaN without a logged step."""
    return logged[max(logged)]["wall_s"] if logged else float("nan")


def retime(record: dict, run_dir: Path) -> dict:
    """A stored record with its training clock redone from its run's ``metrics.csv`` (the end of
    each step, ``tools.heldout_curve``): the curve points' and the run's training seconds."""
    from tools.heldout_curve import training_time_of, wall_at_steps

    logged = wall_at_steps(run_dir)
    curve = [
        {**p, "train_wall_s": (training_time_of(p["step"], logged) or {"wall_s": 0.0})["wall_s"]}
        for p in record.get("curve", [])
    ]
    return {**record, "curve": curve, "train_wall_s": last_end(logged)}


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
