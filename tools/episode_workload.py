"""The pipeline simulator on a multi-turn run: each episode one request of its measured duration.

    python -m tools.episode_workload SYNC_RUN [ASYNC_RUN ...] --validate RUN [RUN ...]
    python -m tools.episode_workload outputs/bench/agent_modes/*sync*/seed* \
        outputs/bench/agent_modes/agent_calculator/seed* --validate outputs/bench/agent_modes/*/seed*

``tools/workload.py`` fits an engine that decodes tokens: a request lasts its length times
the cost of a decoding iteration. An episode that calls a tool is different: most of its wall
time is spent waiting for the tool, outside the engine, where it holds no engine slot. So here
a trained episode is one simulated request whose length is its measured wall duration
(``gen_end - gen_start`` in ``experiences.jsonl``, the tool's latency included) in units of
``unit_s``; the simulated engine has the real one's slots (``engine.max_num_seqs``: the
controllers size what they keep in flight from it, and an episode holds its place while its tool
runs), a unit costs ``unit_s`` seconds however many run, and
the trainer's step is its mean busy time in the fitted runs (``trainer_step_time``). The real
rollout controllers then run on that workload (``tools.pipeline.simulate``): sync waits for
its batch's slowest episode, streaming and partial rollout keep the tail in flight across
weight syncs (a partial rollout abort resumes the episode with its remaining duration, which
is what the real one does when the tool answers on the new weights).

The durations come from the sync runs (no overlap of training and generation, so they are the
workload's own). Given an overlapped run too (streaming or partial), the trainer's slowdown
while episodes generate on the same machine is fitted as well (a step 1.6x longer on this
2-core machine); from sync runs alone a predicted pipeline is as fast as if the trainer had the
machine to itself. ``--validate`` predicts each config among the runs (seeds pooled) and prints
predicted and measured samples/s, and each config's ratio to the sync config, predicted and
measured. Prints one JSON object (last line).

What it leaves out: the engine's own decoding limits (fine while decoding is short next to the
tool's latency, as with the tiny model; not for long model turns), and queueing at the tool
runner's concurrency limit, which differs between modes (measure with a limit the run never
reaches, e.g. ``env.tools.concurrency=256``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from omegaconf import OmegaConf

from modules.engine.sim import SimEngine, SimTask
from modules.launch.compose import build
from tools.pipeline import simulate
from tools.plan import _without_seed, run_config
from tools.workload import (
    Workload,
    fit_trainer,
    is_sync,
    measured_samples_per_s,
    overlap,
    read_overrides,
    read_records,
    trainer_step_time,
)


def fit_episodes(runs: list[Path], unit_s: float = 0.01) -> Workload:
    """A workload whose request lengths are episode durations in units of ``unit_s`` seconds,
    read from the sync runs among ``runs`` (all of them if none is sync). The trainer's step:
    its mean busy time, or with sync and overlapped runs together ``step = t0 (1 + t v)`` over
    the engine's busy share v (``tools.workload.fit_trainer``): on a shared machine a step
    taken while episodes generate is slower."""
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (sample, units, level)
    durations = [r for r in runs if is_sync(r)] or runs
    for i, run in enumerate(durations):
        for r in read_records(run):
            units = max(1, round((float(r["gen_end"]) - float(r["gen_start"])) / unit_s))
            groups.setdefault((i, r["group"]), []).append((int(r["sample"]), units, int(r["level"] or 0)))
    replay = [(g[0][2], [units for _, units, _ in sorted(g)]) for g in groups.values()]
    t0, slow_t = fit_trainer([trainer_step_time(r) for r in runs], [overlap(r)[1] for r in runs])
    return Workload(
        groups=replay,
        step_cost=(unit_s, 0.0),
        prefill_iterations=0.0,
        step_time=t0,
        contention=(0.0, slow_t),  # an episode's time is mostly its tool's, not this machine's
        overrides=read_overrides(durations[0]),
        fit={"runs": [str(r) for r in runs], "unit_s": unit_s, "episodes": sum(map(len, groups.values()))},
    )


def predict_episodes(work: Workload, cfg, seed: int = 0, steps: int | None = None) -> dict:
    """Simulate a composed training config on an episode workload (times in seconds)."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    longest = max(n for _, g in work.groups for n in g)
    cfg.rollout.sampling.max_tokens = longest + 1  # a duration, not tokens: never cut
    per_batch = int(cfg.algo.get("minibatches", 1)) * int(cfg.algo.get("epochs", 1))
    return simulate(
        build(cfg.rollout),
        [],
        max(1, (steps or int(cfg.trainer.max_steps)) // per_batch),
        work.step_time * per_batch,
        None,
        seed=seed,
        sync_every=int(cfg.data.get("sync_every") or 1),
        # the engine's slots as the controllers see them (they size what they keep in flight
        # from it: an episode holds a place while its tool runs), each episode one request
        engine=SimEngine(max_concurrency=cfg.engine.get("max_num_seqs"), step_cost=work.step_cost),
        task=SimTask.from_groups(work.groups),
        contention=work.contention,
    )


def validate_episodes(work: Workload, runs: list[Path], seeds: int = 3) -> list[dict]:
    """Predicted vs measured samples/s per config among ``runs`` (seeds pooled), and each
    config's ratio to the sync config's, predicted and measured."""
    by_config: dict[tuple[str, ...], list[Path]] = {}
    for run in runs:
        by_config.setdefault(_without_seed(read_overrides(run)), []).append(run)
    rows = []
    for overrides, group in by_config.items():
        cfg = run_config(group[0], list(overrides))
        measured = [measured_samples_per_s(r) for r in group]
        predicted = [predict_episodes(work, cfg, seed=s)["samples_per_unit"] for s in range(seeds)]
        rows.append(
            {
                "config": " ".join(o for o in overrides if not o.startswith(("callbacks", "~callbacks"))),
                "sync": is_sync(group[0]),
                "runs": len(group),
                "measured_samples_per_s": statistics.fmean(measured),
                "measured_sd": statistics.stdev(measured) if len(measured) > 1 else 0.0,
                "predicted_samples_per_s": statistics.fmean(predicted),
            }
        )
    base = next((r for r in rows if r["sync"]), None)
    for r in rows:
        r["error"] = r["predicted_samples_per_s"] / r["measured_samples_per_s"] - 1
        if base is not None:
            r["measured_speedup_vs_sync"] = r["measured_samples_per_s"] / base["measured_samples_per_s"]
            r["predicted_speedup_vs_sync"] = r["predicted_samples_per_s"] / base["predicted_samples_per_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="runs to fit (sync, and one overlapped mode)")
    parser.add_argument("--validate", type=Path, nargs="*", default=[])
    parser.add_argument("--unit-s", type=float, default=0.01, help="seconds per simulated unit")
    args = parser.parse_args()
    work = fit_episodes(args.runs, args.unit_s)
    out = {**work.summary(), "validation": validate_episodes(work, args.validate) if args.validate else []}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
