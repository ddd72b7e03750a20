"""Pipeline simulator / planner: predict what a rollout config does before spending GPU hours.

    python -m tools.pipeline                                   # seed workload, streaming
    python -m tools.pipeline rollout=sync
    python -m tools.pipeline rollout=partial rollout.over_provision=2
    python -m tools.pipeline rollout=streaming rollout.max_staleness=2 sim.step_time=10
    python -m tools.pipeline -m rollout=sync,partial,streaming  # compare the modes
    python -m tools.pipeline rollout=partial sim.sync_time=20    # a weight sync costs 20 units

The real rollout controllers (``data/rollout``: group assembler, buffer, staleness
policies, carry-over) are driven by ``SimEngine`` (each request takes its length in time
units; ``sim.concurrency`` requests at once) and a simulated trainer (``sim.step_time`` per
update), on a virtual clock, so a run takes seconds. The default workload is the seeds': 90 %
of requests take 10 units, 10 % take 100, one update per 32 samples. ``sim.sync_time``
(default 0) charges each weight sync: the engine stops decoding and the trainer waits that
long per version (``pause``; ``lab/scaling.py`` derives it from bytes and bandwidth).

Prints one JSON object (last line): trained samples per time unit, trainer and engine idle
fractions, engine utilisation, staleness histogram, completion-time bias, next to the
analytical bounds: a sync iteration lasts at least E[max(longest response, the batch's work /
concurrency)] + step time (whatever the order requests start in); no pipeline beats
min(concurrency / mean latency, batch / step time). Both are given for the issued mix
(``ratio_to_pipeline_bound``) and for the mix actually trained (``ratio_to_trained_mix_bound``):
dropping long groups trains a shorter mix, whose bound is higher, so a dropping config can pass
the issued mix's bound while wasting generation; the second ratio shows the waste.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from typing import Any

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from data.rollout.controller import RolloutContext
from data.rollout.prompts import PromptStream
from modules.algo.advantages import GroupAdvantage
from modules.engine.sim import CharTokenizer, SimEngine, SimTask


def expected_max(latencies: list[tuple[float, float]], n: int) -> float:
    """E[max of n i.i.d. draws] from a discrete [(value, probability), ...] distribution."""
    pts = sorted(latencies)
    total = sum(p for _, p in pts)
    out, cdf_prev = 0.0, 0.0
    for v, p in pts:
        cdf = cdf_prev + p / total
        out += v * (cdf**n - cdf_prev**n)
        cdf_prev = cdf
    return out


def sync_makespan(
    latencies: list[tuple[float, float]],
    batch: int,
    concurrency: int,
    group_size: int = 1,
    draws: int = 4000,
) -> float:
    """E[max(longest response, total work / concurrency)] over barrier batches of ``batch``
    responses: ``batch / group_size`` prompts drawn i.i.d., the G responses of a prompt equally
    long (as the simulator's task makes them). No schedule of one batch on ``concurrency`` slots
    finishes sooner: the longest request runs on one slot, and the slots do at most
    ``concurrency`` units of work per unit. Monte Carlo with a fixed seed; exact
    ``expected_max`` when everything starts at once (``concurrency >= batch``)."""
    prompts = max(1, math.ceil(batch / group_size))
    if concurrency >= batch:
        return expected_max(latencies, prompts)
    rng = random.Random(0)
    values = [v for v, _ in latencies]
    weights = [p for _, p in latencies]
    total = 0.0
    for _ in range(draws):
        xs = rng.choices(values, weights, k=prompts)
        total += max(max(xs), group_size * sum(xs) / concurrency)
    return total / draws


def bounds(
    latencies: list[tuple[float, float]],
    batch: int,
    concurrency: int,
    step_time: float,
    max_tokens: float | None = None,
    group_size: int = 1,
    sync_every: int = 1,
    sync_time: float = 0.0,
) -> dict:
    """Analytical sync and pipeline bounds. A response stops at ``max_tokens`` (one time unit
    per token), so latencies above it count as ``max_tokens``: without that clip a workload with
    a tail beyond the cap would make "sync" beat its own bound. A sync iteration cannot be
    shorter than its batch's makespan bound (``sync_makespan``: the longest response, or the
    batch's work spread over the engine's slots when the batch exceeds them) plus the step.

    ``staleness_floor_at_bound``: every sample generating or waiting when the weights change
    gains a version, and a version trains ``batch * sync_every`` samples. A pipeline at the
    bound that trains the issued mix has about bound x E[L] samples generating (Little's law;
    for a generation-bound pipeline that is the whole engine, ``concurrency``), so its mean
    staleness is at least about bound x E[L] / (batch x sync_every). It says nothing about a
    pipeline below the bound (sync is at staleness 0), nor about one that drops long groups.

    ``sync_time``: each version's weight sync stops both sides for that long (``pause``). A
    sync iteration gains it; the trainer feeds at most ``batch * sync_every / (step_time *
    sync_every + sync_time)``, and the engine, paused ``sync_time`` per version of ``batch *
    sync_every`` samples, at most ``1 / (mean latency / concurrency + sync_time / (batch *
    sync_every))``."""
    if max_tokens is not None:
        latencies = [(min(v, max_tokens), p) for v, p in latencies]
    total = sum(p for _, p in latencies)
    mean_latency = sum(v * p for v, p in latencies) / total
    sync_iter = sync_makespan(latencies, batch, concurrency, group_size) + step_time + sync_time / sync_every
    per_version = batch * sync_every
    engine = 1.0 / (mean_latency / concurrency + sync_time / per_version)
    trainer_time = step_time * sync_every + sync_time
    bound = min(engine, per_version / trainer_time if trainer_time else math.inf)
    return {
        "sync_samples_per_unit": batch / sync_iter,
        "pipeline_bound_samples_per_unit": bound,
        "mean_latency": mean_latency,
        "sync_iteration_time": sync_iter,
        "staleness_floor_at_bound": bound * mean_latency / (batch * sync_every),
    }


def ratios(
    result: dict,
    latencies: list[tuple[float, float]],
    batch: int,
    concurrency: int,
    step_time: float,
    max_tokens: float | None,
    group_size: int = 1,
    sync_every: int = 1,
    sync_time: float = 0.0,
) -> dict:
    """A simulated run's throughput against the bounds of the issued mix and of the mix it
    trained. A run that drops long groups trains a shorter mix than it issues and can pass the
    issued mix's bound; against its own mix's bound (what an engine generating only those
    responses could feed) the shortfall is the generation it wasted and the trainer's idling."""
    b = bounds(latencies, batch, concurrency, step_time, max_tokens, group_size, sync_every, sync_time)
    trained = [(float(k), v) for k, v in (result.get("trained_lengths") or {}).items()]
    mix = (
        bounds(trained, batch, concurrency, step_time, None, group_size, sync_every, sync_time)
        if trained
        else b
    )
    spu = result["samples_per_unit"]
    return {
        "bounds": b,
        "trained_mix_bounds": mix,
        "ratio_to_pipeline_bound": spu / b["pipeline_bound_samples_per_unit"],
        "ratio_to_trained_mix_bound": spu / mix["pipeline_bound_samples_per_unit"],
        "speedup_vs_sync_bound": spu / b["sync_samples_per_unit"],
    }


def quantile(hist: Counter, q: float) -> float:
    """The q-quantile (lower) of a histogram {value: count}; nan when empty."""
    n = sum(hist.values())
    seen = 0
    for v in sorted(hist):
        seen += hist[v]
        if seen >= q * n:
            return float(v)
    return float("nan")


def pause(engine: SimEngine, dt: float) -> None:
    """The engine stops decoding for ``dt`` time units (a weight sync): the wall clock moves,
    the token clock does not, nothing completes, and the pause counts as engine idle. Works on
    any ``SimEngine`` (default or fitted), from outside it: its clocks and busy accounting are
    ``now``, ``tick`` and ``_account`` / ``_last``."""
    if dt <= 0:
        return
    engine._account(engine.now)  # running requests were busy up to now
    engine.now += dt
    engine._last = engine.now  # ... and idle during the pause


def simulate(
    controller: Any,
    latencies: list[tuple[float, float]],
    steps: int,
    step_time: float,
    concurrency: int | None,
    num_prompts: int = 20000,
    seed: int = 0,
    sync_every: int = 1,
    engine: SimEngine | None = None,
    task: SimTask | None = None,
    contention: tuple[float, float] = (0.0, 0.0),
    sync_time: float = 0.0,
) -> dict[str, Any]:
    """Run ``steps`` trainer updates of ``controller`` on a SimEngine; return the figures.
    ``engine`` / ``task`` replace the default ones (one unit per token; ``latencies``), e.g.
    with a workload fitted to a real run (``tools/workload.py``). ``contention=(e, t)``:
    engine and trainer share a machine; while the trainer steps, a decoding iteration costs
    1 + e times as much, and a step that starts while requests generate takes 1 + t times as
    long (0, 0: separate devices). ``sync_time``: every weight sync pauses the engine and the
    trainer for that long (``pause``; in the trainer's busy time, not its idle fraction)."""
    engine = engine or SimEngine(max_concurrency=concurrency)
    concurrency = engine.max_concurrency
    task = task or SimTask.mixture(latencies, num_prompts, seed)
    controller.batches_per_version = sync_every  # before bind: sizing reads it
    controller.bind(
        RolloutContext(engine, task, CharTokenizer(), PromptStream(task.rows, seed=seed), GroupAdvantage())
    )
    waited, trained, syncs = 0.0, 0, 0
    staleness: Counter = Counter()  # histogram, 5+ pooled (display)
    lengths: Counter = Counter()  # trained response lengths (tokens)
    stale_sum, stale_max = 0, 0  # exact
    stale_exact: Counter = Counter()
    for step in range(steps):
        t0 = engine.now
        batch = controller.next_batch()
        waited += engine.now - t0
        trained += len(batch)
        staleness.update(min(e.staleness, 5) for e in batch)
        lengths.update(len(e.response_ids) for e in batch)
        stale_sum += sum(e.staleness for e in batch)
        stale_exact.update(e.staleness for e in batch)
        stale_max = max([stale_max, *(e.staleness for e in batch)])
        slow_e, slow_t = contention
        engine.slowdown = 1.0 + slow_e
        busy = step_time * (1.0 + slow_t * engine.busy)
        engine.advance_to(engine.now + busy)  # the update; generation goes on meanwhile
        engine.slowdown = 1.0
        if (step + 1) % sync_every == 0:
            engine.update_weights({}, engine.version + 1, inflight=controller.inflight)
            pause(engine, sync_time)
            syncs += 1
    total = engine.now
    n_stale = sum(staleness.values())
    snap = controller.snapshot()
    return {
        "time": total,
        "trained_samples": trained,
        "samples_per_unit": trained / total,
        "trainer_idle_frac": waited / total,
        "sync_frac": syncs * sync_time / total,
        "engine_idle_frac": 1 - engine.busy_time / total,
        "engine_utilisation": engine.slot_time / (total * concurrency) if concurrency else float("nan"),
        "staleness_hist": {str(k): v / n_stale for k, v in sorted(staleness.items())},
        "staleness_mean": stale_sum / n_stale,
        "staleness_max": stale_max,
        "staleness_p95": quantile(stale_exact, 0.95),
        "dropped_groups": snap.get("dropped", 0),
        "trained_lengths": {str(k): v / trained for k, v in sorted(lengths.items())} if trained else {},
        **controller.bias.metrics(),
    }


def pipeline_config(overrides: list[str]) -> DictConfig:
    """``conf/pipeline.yaml`` composed with ``overrides`` outside ``@hydra.main`` (the planner,
    the scaling benchmark)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from modules.launch.compose import ROOT

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return hydra_compose("pipeline", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


@hydra.main(version_base="1.3", config_path="../conf", config_name="pipeline")
def main(cfg: DictConfig) -> float:
    sim = cfg.sim
    latencies = [tuple(x) for x in sim.latencies]
    controller = instantiate(cfg.rollout)
    result = simulate(
        controller,
        latencies,
        sim.steps,
        sim.step_time,
        sim.concurrency,
        sim.num_prompts,
        cfg.seed,
        sim.sync_every,
        sync_time=sim.get("sync_time", 0.0),
    )
    batch = controller.prompts_per_step * controller.group_size
    conc = sim.concurrency or batch
    g, every = controller.group_size, sim.sync_every
    max_tokens = controller.sampling.max_tokens
    sync_time = sim.get("sync_time", 0.0)
    result.update(ratios(result, latencies, batch, conc, sim.step_time, max_tokens, g, every, sync_time))
    result["mode"] = type(controller).__name__
    result.pop("trained_lengths")
    print(json.dumps(result))
    return result["samples_per_unit"]


if __name__ == "__main__":
    main()
