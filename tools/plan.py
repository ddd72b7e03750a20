"""Planner: simulate candidate rollout configs on a workload and recommend one for a staleness
budget, before spending accelerator hours on a sweep.

    python -m tools.plan                                   # the seeds' workload, budget 2
    python -m tools.plan sim=lognormal --budget 1 --max-level-kl 0.01
    python -m tools.plan sim=bimodal --steps 200 --json

Each candidate (mode; staleness bound K; staleness policy; in-flight handling at a weight sync;
over-provisioning for partial rollout, fixed or ``auto``; cancelling doomed groups) runs
through ``tools.pipeline.simulate``: the real rollout controllers on the simulator's
virtual clock with the workload's latency mix, concurrency and step time (``conf/sim/``).
Printed per candidate: trained samples per time unit and as a share of the pipeline bound
(of the issued mix, and of the mix it trains: a config that drops long groups can pass the
first, the second shows what it wastes), mean staleness, the share of issued groups dropped, and the level bias of what is trained
(KL of trained vs issued difficulty levels: what dropping long groups costs). The
recommendation is the fastest candidate whose mean staleness is within ``--budget`` and whose
level KL is within ``--max-level-kl``.

From finished runs (``--from-run RUN [RUN ...]``, pooled; a sync and an async run together
also fit how much generation and training slow each other on a shared machine): the workload, engine and trainer are fitted to the
run's own records (``tools/workload.py``: its groups' lengths, a decoding iteration cost
``a + b * running`` and a prefill delay, the trainer's busy time per step), the candidates
keep the run's task, model and batch, and the figures are in samples per second.
``--validate RUN...`` predicts each run's own config on that fitted workload and prints it next
to the run's measured samples/s (runs that differ only in seed are averaged).

    python -m tools.plan --from-run outputs/sync_grpo/<time> --budget 1
    python -m tools.plan --from-run SYNC_RUN ASYNC_RUN --validate outputs/bench/modes5/*/seed*

Without ``--from-run`` the simulator's engine takes one time unit per token per request however
many run at once (a GPU-like engine); its predictions are for the workload as described. That
engine charges nothing to re-prefill a resubmitted request, so aborting in-flight requests at a
sync (``rollout.inflight=abort``) predicts exactly what keeping them does; a fitted engine
(``--from-run``) charges its measured prefill delay to every resubmission.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from modules.engine.sim import SimEngine, SimTask
from modules.launch.compose import build, compose
from tools.pipeline import pipeline_config, ratios, simulate
from tools.workload import Workload, fit, measured_samples_per_s, read_overrides


@dataclass(frozen=True)
class Candidate:
    name: str
    overrides: tuple[str, ...]


def candidates() -> list[Candidate]:
    out = [
        Candidate("sync", ("rollout=sync",)),
        Candidate("sync, longest first", ("rollout=sync", "rollout.schedule=longest_first")),
    ]
    out.append(Candidate("partial alpha auto", ("rollout=partial", "rollout.over_provision=auto")))
    for alpha in (1.5, 2.0):
        out.append(
            Candidate(f"partial alpha {alpha:g}", ("rollout=partial", f"rollout.over_provision={alpha}"))
        )
    for k in (1, 2, 4, 8):
        auto = (
            "rollout=streaming",
            "rollout.max_inflight=auto",
            "rollout.buffer_capacity=auto",
            f"rollout.max_staleness={k}",
        )
        out.append(Candidate(f"streaming K={k} drop", (*auto, "rollout.cancel_doomed=false")))
        out.append(Candidate(f"streaming K={k} drop + cancel", (*auto, "rollout.cancel_doomed=true")))
        out.append(Candidate(f"streaming K={k} admit", (*auto, "rollout/staleness=admit")))
        out.append(Candidate(f"streaming K={k} throttle", (*auto, "rollout/staleness=throttle")))
        out.append(Candidate(f"streaming K={k} regenerate", (*auto, "rollout/staleness=regenerate")))
        out.append(Candidate(f"streaming K={k} abort in-flight", (*auto, "rollout.inflight=abort")))
    return out


def run(sim: str, extra: list[str], steps: int, seed: int, budget: float, max_level_kl: float) -> dict:
    rows = []
    for c in candidates():
        cfg = pipeline_config([f"sim={sim}", *c.overrides, *extra])
        ctl = build(cfg.rollout)
        lat = [tuple(x) for x in cfg.sim.latencies]
        out = simulate(
            ctl,
            lat,
            steps,
            cfg.sim.step_time,
            cfg.sim.concurrency,
            cfg.sim.num_prompts,
            seed,
            cfg.sim.sync_every,
            sync_time=cfg.sim.get("sync_time", 0.0),
        )
        batch = ctl.prompts_per_step * ctl.group_size
        conc = cfg.sim.concurrency or batch
        max_tokens, every = ctl.sampling.max_tokens, cfg.sim.sync_every
        sync_time = cfg.sim.get("sync_time", 0.0)
        r = ratios(out, lat, batch, conc, cfg.sim.step_time, max_tokens, ctl.group_size, every, sync_time)
        trained = out["trained_samples"] / ctl.group_size
        dropped = out["dropped_groups"]
        rows.append(
            {
                "candidate": c.name,
                "overrides": list(c.overrides),
                "samples_per_unit": out["samples_per_unit"],
                "of_pipeline_bound": r["ratio_to_pipeline_bound"],
                "of_trained_mix_bound": r["ratio_to_trained_mix_bound"],
                "staleness_mean": out["staleness_mean"],
                "staleness_max": out["staleness_max"],
                "drop_rate": dropped / (dropped + trained) if dropped + trained else 0.0,
                "level_kl": out.get("bias/level_kl_trained_vs_issued", 0.0),
                "trainer_idle_frac": out["trainer_idle_frac"],
            }
        )
    ok = [r for r in rows if r["staleness_mean"] <= budget and r["level_kl"] <= max_level_kl]
    best = max(ok, key=lambda r: r["samples_per_unit"]) if ok else None
    return {
        "sim": sim,
        "budget": budget,
        "max_level_kl": max_level_kl,
        "candidates": rows,
        "recommended": best,
    }


def predict(work: Workload, overrides: list[str], seed: int = 0, steps: int | None = None) -> dict:
    """Simulate the training config ``overrides`` on a fitted workload (times in seconds).
    ``steps`` counts optimizer steps, as ``trainer.max_steps`` does; the simulator steps once per
    rollout batch, i.e. per ``algo.minibatches x algo.epochs`` optimizer steps."""
    return predict_config(work, compose(overrides), seed, steps)


def predict_config(work: Workload, cfg, seed: int = 0, steps: int | None = None) -> dict:
    """``predict`` for a composed training config (e.g. a run's own ``.hydra/config.yaml``)."""
    ctl = build(cfg.rollout)
    per_batch = int(cfg.algo.get("minibatches", 1)) * int(cfg.algo.get("epochs", 1))
    engine = SimEngine(
        max_concurrency=cfg.engine.get("max_num_seqs"),
        step_cost=work.step_cost,
        prefill_iterations=work.prefill_iterations,
    )
    return simulate(
        ctl,
        [],
        max(1, (steps or int(cfg.trainer.max_steps)) // per_batch),
        work.step_time * per_batch,
        None,
        seed=seed,
        sync_every=int(cfg.data.get("sync_every") or 1),
        engine=engine,
        task=SimTask.from_groups(work.groups),
        contention=work.contention,
    )


def run_config(run: Path, overrides: list[str]):
    """The config a run trained with: its saved ``.hydra/config.yaml`` (a recipe's defaults may
    have changed since), else its overrides composed today."""
    from omegaconf import OmegaConf

    saved = run / ".hydra" / "config.yaml"
    return OmegaConf.load(saved) if saved.exists() else compose(overrides)


def _without_seed(overrides: list[str]) -> tuple[str, ...]:
    return tuple(o for o in overrides if not re.match(r"^seed=", o))


def validate(work: Workload, runs: list[Path]) -> list[dict]:
    """Predicted vs measured samples/s for each config among ``runs`` (seeds pooled)."""
    by_config: dict[tuple[str, ...], list[Path]] = {}
    for run in runs:
        by_config.setdefault(_without_seed(read_overrides(run)), []).append(run)
    rows = []
    for overrides, group in by_config.items():
        measured = [measured_samples_per_s(r) for r in group]
        cfg = run_config(group[0], list(overrides))
        sims = [predict_config(work, cfg, seed=s)["samples_per_unit"] for s in range(3)]
        pred = statistics.fmean(sims)
        mean = statistics.fmean(measured)
        rows.append(
            {
                "config": " ".join(o for o in overrides if not o.startswith(("callbacks", "~callbacks"))),
                "runs": len(group),
                "measured_samples_per_s": mean,
                "measured_sd": statistics.stdev(measured) if len(measured) > 1 else 0.0,
                "predicted_samples_per_s": pred,
                "error": pred / mean - 1,
            }
        )
    return rows


def plan_from_run(work: Workload, steps: int, seed: int, budget: float, max_level_kl: float) -> dict:
    """The candidates on a run's fitted workload: its task, model, engine and batch (prompts,
    group size, max tokens, minibatches, epochs, sync cadence), other rollout configs."""
    first = (work.fit.get("runs") or [None])[0]
    run = run_config(Path(first), work.overrides) if first else compose(work.overrides)
    keep = [
        o
        for o in work.overrides
        if o.split("=", 1)[0] in ("task", "model", "engine")
        or o.startswith(("task.", "model.", "engine.", "data."))
    ]
    keep += [
        f"rollout.prompts_per_step={run.rollout.prompts_per_step}",
        f"rollout.group_size={run.rollout.group_size}",
        f"rollout.sampling.max_tokens={run.rollout.sampling.max_tokens}",
        f"algo.minibatches={run.algo.get('minibatches', 1)}",
        f"algo.epochs={run.algo.get('epochs', 1)}",
        f"data.sync_every={run.data.get('sync_every') or 1}",
        f"engine.max_num_seqs={run.engine.get('max_num_seqs')}",
    ]
    base = compose(["recipe=sync_grpo", *keep])
    batch = int(base.rollout.prompts_per_step) * int(base.rollout.group_size)
    bound = work.bounds(batch, int(base.engine.get("max_num_seqs") or batch))["pipeline_bound_samples_per_s"]
    rows = []
    for c in candidates():
        out = predict(work, ["recipe=sync_grpo", *keep, *c.overrides], seed, steps)
        trained = out["trained_samples"]
        dropped = out["dropped_groups"]
        group = int(base.rollout.group_size)
        rows.append(
            {
                "candidate": c.name,
                "overrides": list(c.overrides),
                "samples_per_unit": out["samples_per_unit"],
                "of_pipeline_bound": out["samples_per_unit"] / bound,
                "staleness_mean": out["staleness_mean"],
                "staleness_max": out["staleness_max"],
                "drop_rate": dropped / (dropped + trained / group) if dropped + trained else 0.0,
                "level_kl": out.get("bias/level_kl_trained_vs_issued", 0.0),
                "trainer_idle_frac": out["trainer_idle_frac"],
            }
        )
    ok = [r for r in rows if r["staleness_mean"] <= budget and r["level_kl"] <= max_level_kl]
    best = max(ok, key=lambda r: r["samples_per_unit"]) if ok else None
    return {
        "workload": work.summary(),
        "budget": budget,
        "max_level_kl": max_level_kl,
        "candidates": rows,
        "recommended": best,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="sim=<workload> and sim.* / rollout.* overrides")
    parser.add_argument("--budget", type=float, default=2.0, help="mean staleness allowed (versions)")
    parser.add_argument("--max-level-kl", type=float, default=0.01, help="level bias allowed (nats)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="only the JSON")
    parser.add_argument("--from-run", type=Path, nargs="+", help="fit the workload to these finished runs")
    parser.add_argument("--validate", type=Path, nargs="+", help="runs to predict (with --from-run)")
    args = parser.parse_args()
    if args.validate and not args.from_run:
        parser.error("--validate needs --from-run (the run whose workload is fitted)")
    if args.from_run:
        work = fit(args.from_run)
        if args.validate:
            rows = validate(work, args.validate)
            for r in rows:
                print(
                    f"{r['config']:70} measured {r['measured_samples_per_s']:6.1f} +- {r['measured_sd']:4.1f} "
                    f"(n={r['runs']}) predicted {r['predicted_samples_per_s']:6.1f} ({r['error']:+.0%})"
                )
            print(json.dumps({"workload": work.summary(), "validation": rows}))
            return
        result = plan_from_run(work, args.steps, args.seed, args.budget, args.max_level_kl)
    else:
        sim = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("sim=")), "seed_workload")
        extra = [o for o in args.overrides if not o.startswith("sim=")]
        result = run(sim, extra, args.steps, args.seed, args.budget, args.max_level_kl)
    if not args.json:
        print(
            f"{'candidate':34} {'samples/unit':>12} {'of bound':>8} {'of mix':>6} {'staleness':>9} "
            f"{'dropped':>7} {'level KL':>8}"
        )
        for r in sorted(result["candidates"], key=lambda r: -r["samples_per_unit"]):
            print(
                f"{r['candidate']:34} {r['samples_per_unit']:12.3f} {r['of_pipeline_bound']:8.2f} "
                + (f"{r['of_trained_mix_bound']:6.2f} " if "of_trained_mix_bound" in r else f"{'-':>6} ")
                + f"{r['staleness_mean']:9.2f} {r['drop_rate']:7.2f} {r['level_kl']:8.3f}"
            )
        rec = result["recommended"]
        print(
            "recommended:",
            "none within the budget" if rec is None else f"{rec['candidate']}: {' '.join(rec['overrides'])}",
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
