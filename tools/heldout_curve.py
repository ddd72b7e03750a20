"""Held-out reward vs training wall-clock of a finished run, evaluated after training from its
checkpoints.

    python -m tools.heldout_curve outputs/bench/modes/sync_grpo/seed0

``lab.modes`` runs this after every training run (it also makes the run save a checkpoint
every few policy versions). Evaluating afterwards, not inside training, keeps evaluation out of
the training clock exactly: an in-training evaluation pauses the trainer, but in the streaming
and partial modes the engine keeps generating training samples during it, so subtracting its
duration would still credit those modes with free generation time (and ``perf/samples_per_s``
would include the pauses).

It reads the run's ``train.py`` overrides (``RUN/.hydra/overrides.yaml``), composes the same
config, starts the same engine and ``RolloutDataModule`` (same held-out prompts, greedy and
sampled passes, per-request seeds), then evaluates the initial weights (``model.path``) at
training time 0, the trainer's weights from every ``RUN/checkpoints/*step=N*.ckpt`` and, if no
checkpoint holds the final step, the final weights from ``RUN/hf_model``. After
each load the engine scores one sequence and must match the trainer's logprobs within
``callbacks.weight_sync.tolerance`` (three probes; two over it fail, as WeightSync's rule). A
checkpoint's training wall time is the end of the training step that produced those weights
(``metrics.csv`` row ``step = N - 1``): seconds since the first training step began. ``train.py``
logs ``perf/wall_s`` after a step's forward pass, so its backward, optimizer and overhead seconds
(logged on the same row) are added; the TRL peer logs after the optimizer step and has none.
(Before 2026-12-07 the forward's end was used, one backward + optimizer step early: the same
in every project mode, but early against TRL; ``lab.modes --from-log ... --retime DIR`` redoes
a stored sitting's clock from its run directories.) Writes ``RUN/heldout_curve.json`` and
prints it as one JSON line.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

CKPT_STEP = re.compile(r"step=(\d+)")


def step_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(global step, path) of the run's step checkpoints, one per step, by step."""
    found: dict[int, Path] = {}
    for path in sorted((run_dir / "checkpoints").glob("*.ckpt")):
        m = CKPT_STEP.search(path.name)
        if m and path.name != "last.ckpt":
            found.setdefault(int(m.group(1)), path)
    return sorted(found.items())


def wall_at_steps(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.csv rows logged by training steps, by step: the step's end (``perf/wall_s`` plus
    what the step did after logging it) and ``perf/samples_total``."""
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    out = {}
    rest = ("perf/step_backward_s", "perf/step_optimizer_s", "perf/step_overhead_s")  # after the log
    for r in rows:
        if r.get("perf/wall_s") and r.get("step"):
            out[int(r["step"])] = {
                "wall_s": float(r["perf/wall_s"]) + sum(float(r[k]) for k in rest if r.get(k)),
                "samples": float(r["perf/samples_total"]),
            }
    return out


def training_time_of(step: int, logged: dict[int, dict[str, float]]) -> dict[str, float] | None:
    """Wall time and samples when the weights after ``step`` optimizer steps existed: the row of
    step ``step - 1`` (or the last logged before it, if that step was skipped as non-finite)."""
    before = [s for s in logged if s <= step - 1]
    return logged[max(before)] if before else None


def run_overrides(run_dir: Path) -> list[str]:
    saved = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) or []
    return [o for o in saved if not o.lstrip("+~").startswith("hydra.")]


def evaluate_run(run_dir: Path, initial: Path | None = None) -> dict[str, Any]:
    import torch
    from hydra.utils import instantiate

    from modules.launch.compose import compose as compose_config
    from modules.policy.hf_policy import build_policy, load_policy, named_weights, token_logprobs

    cfg = compose_config(run_overrides(run_dir), output_dir=str(run_dir))
    torch.set_num_threads(cfg.torch_threads)
    from modules.callbacks.weight_sync import OUTLIER_FACTOR, verify_tolerance

    tolerance = verify_tolerance(cfg.callbacks.weight_sync.tolerance, cfg.engine.dtype)
    logged = wall_at_steps(run_dir)
    ckpts = step_checkpoints(run_dir)
    dm = instantiate(cfg.data)
    dm.setup("fit")  # starts the engine (initial weights: model.path); no rollout generation
    points: list[dict[str, Any]] = []
    probe_diffs: list[dict[str, Any]] = []  # every probe's gap at every load
    max_diff = 0.0
    try:
        # three held-out prompts as the engine is given them (a chat model's template included)
        probes = [dm.prompt_format.ids(dm.tokenizer, dm.task.prompt_text(r)) for r in dm.eval_rows[:3]]
        t0 = time.perf_counter()
        # The starting policy is model.path for every run of a config: with ``initial`` its
        # evaluation is read from there when a run before this one wrote it (same weights,
        # same prompts and per-request seeds), else made and written there.
        initial_weights = weights_fingerprint(Path(cfg.module.model_path))
        key = json.dumps(
            {
                "model": str(cfg.module.model_path),
                "weights": initial_weights,
                "engine": OmegaConf.to_container(cfg.engine, resolve=True),
                "eval": eval_signature(dm),
            },
            sort_keys=True,
            default=str,
        )
        cache = None
        if initial is not None:
            initial.mkdir(parents=True, exist_ok=True)
            cache = initial / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
        cached = read_json(cache) if cache is not None else None
        if cached is not None and cached.get("key") == key:
            start = cached["metrics"]
        else:
            start = dm.evaluate()
            if cache is not None:  # written whole, then renamed: a reader never sees half a file
                tmp = cache.with_suffix(".tmp")
                tmp.write_text(json.dumps({"key": key, "metrics": start}))
                tmp.replace(cache)
        points.append({"step": 0, "policy_version": 0, "train_wall_s": 0.0, "samples": 0.0, **start})
        # the trainer's own layout (LoRA adapters too), so its checkpoints load strictly
        lora = cfg.module.get("lora")
        policy, _ = build_policy(cfg.module.model_path, lora=instantiate(lora) if lora else None)
        policy.eval()
        # The final weights: the last step checkpoint, or else the run's hf_model (saved at the
        # end of training) when the checkpoint cadence does not divide the number of steps.
        final_step = max(logged) + 1 if logged else 0
        sources: list[tuple[int, Path]] = list(ckpts)
        if final_step not in dict(ckpts) and (run_dir / "hf_model" / "config.json").exists():
            sources.append((final_step, run_dir / "hf_model"))
        for step, path in sources:
            when = training_time_of(step, logged)
            if when is None:
                continue
            model = policy
            if path.is_dir():  # hf_model: a plain HF model (merged, under LoRA)
                model, _ = load_policy(path)
                model.eval()
                version = -1  # not recorded in hf_model
            else:
                ckpt = torch.load(path, map_location="cpu", weights_only=False)  # written by this run
                state = {
                    k.removeprefix("policy."): v
                    for k, v in ckpt["state_dict"].items()
                    if k.startswith("policy.")
                }
                policy.load_state_dict(state)
                version = int(ckpt.get("asyncrl", {}).get("policy_version", step))
            dm.sync_weights(named_weights(model), max(version, 0))
            diffs = []
            for probe in probes:
                engine_lp = torch.tensor(dm.engine_logprobs(probe))
                with torch.no_grad():
                    ids = torch.tensor([probe])
                    lp, _ = token_logprobs(model, ids, torch.ones_like(ids), 1.0)
                diffs.append(float((lp[0] - engine_lp).abs().max()))
            max_diff = max(max_diff, *diffs) if all(d == d for d in diffs) else float("nan")
            probe_diffs.append({"step": step, "diffs": diffs})
            # WeightSync's rule: a wrong sync moves every sequence, a bf16 kernel one at most;
            # a probe non-finite or OUTLIER_FACTOR x over fails alone
            over = [not d <= tolerance for d in diffs]
            if any(not d <= OUTLIER_FACTOR * tolerance for d in diffs) or sum(over) >= min(2, len(diffs)):
                raise RuntimeError(f"{path}: engine logprobs differ from the checkpoint's by {diffs}")
            if any(over):
                print(f"{path}: one probe over the tolerance {tolerance}: {diffs}", file=sys.stderr)
            points.append(
                {
                    "step": step,
                    "policy_version": version,
                    "train_wall_s": when["wall_s"],
                    "samples": when["samples"],
                    **dm.evaluate(),
                }
            )
        eval_s = time.perf_counter() - t0
    finally:
        dm.teardown("fit")
    summary_path = run_dir / "eval_summary.json"
    inline = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    result = {
        "run_dir": str(run_dir),
        "points": points,
        # which build of the warm start the run began from (a rebuild on another machine can
        # differ in the last bits: runs from two builds do not pair exactly)
        "initial_weights": initial_weights,
        "sources": [str(p) for _, p in sources],
        "weight_check_max_abs_diff": max_diff,
        "weight_check_probes": probe_diffs,
        "posthoc_eval_s": eval_s,
        # Same weights, same prompts and seeds as the in-training first / last evaluation:
        # these should agree up to engine batching effects (a sanity check of the method).
        "inline_first": {k: v for k, v in inline.get("first", {}).items() if k.startswith("eval/")},
        "inline_last": {k: v for k, v in inline.get("last", {}).items() if k.startswith("eval/")},
        "inline_last_step": inline.get("last", {}).get("step"),
    }
    (run_dir / "heldout_curve.json").write_text(json.dumps(result, indent=1))
    return result


def weights_fingerprint(model_dir: Path) -> str:
    """sha256 over the model directory's weight files (a rebuilt warm start at the same path
    gets a new key)."""
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def eval_signature(dm: Any) -> dict[str, Any]:
    """What the held-out evaluation of a policy depends on besides its weights."""
    ev = dm.evaluator
    return {
        "rows": [dm.prompt_format.render(dm.tokenizer, dm.task.prompt_text(r)) for r in dm.eval_rows],
        "temperature": ev.temperature,
        "max_tokens": ev.max_tokens,
        "samples": ev.samples,
        "task": repr(dm.task),  # per-request sampling seeds: the engine's own seed plays no part
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument(
        "--initial",
        type=Path,
        help="folder caching the starting policy's evaluation across runs (one file per model "
        "and evaluation config)",
    )
    args = parser.parse_args()
    print(json.dumps(evaluate_run(args.run_dir.resolve(), args.initial)))


if __name__ == "__main__":
    main()
