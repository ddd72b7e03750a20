"""Part 3 of ``lab.scaling``: the pipeline simulator at G GPUs, each rollout mode through the real
rollout controllers with replicas as one ``SimEngine`` and a weight sync that pauses it for the
cost model's time.

Imported by ``lab.scaling`` (run that: ``python -m lab.scaling ...``); the reductions that keep a
run in seconds are in ``simulate_scale``'s docstring.
"""

from __future__ import annotations

import math
import time

from lab.scaling_costs import Dist, Gpu, Model, gpu_split, place, sync_cost
from modules.engine.sim import SimEngine
from modules.launch.compose import build
from tools.pipeline import bounds, pipeline_config, simulate

# --- 3. the simulator at scale ------------------------------------------------------------


def workload(scale: float = 200.0) -> Dist:
    """``conf/sim/lognormal.yaml`` (median 20, sigma 1.5, 20 bins) x ``scale`` tokens."""
    return [(v * scale, p) for v, p in pipeline_config(["sim=lognormal"]).sim.latencies]


def mode_overrides(max_staleness: int) -> dict[str, list[str]]:
    return {
        "sync": ["rollout=sync"],
        "partial": ["rollout=partial", "rollout.over_provision=auto"],
        f"streaming K={max_staleness}": [
            "rollout=streaming",
            "rollout/staleness=drop",
            "rollout.max_inflight=auto",
            "rollout.buffer_capacity=auto",
            f"rollout.max_staleness={max_staleness}",
            "rollout.cancel_doomed=true",
        ],
    }


def simulate_scale(
    gpus: int,
    model: Model,
    gpu: Gpu,
    dist: Dist,
    max_tokens: int,
    prompt_tokens: float = 1024,
    group_size: int = 8,
    samples_per_gpu: int | None = None,
    steps: int = 60,
    staleness: tuple[int, ...] = (2,),
    sync: tuple[str, ...] = ("tree", "push"),
    fixed_s: float = 0.5,
    seed: int = 0,
    split_kw: dict | None = None,
    chunk: float = 50.0,
    slice_gpus: int | None = None,
) -> dict:
    """Each mode at G GPUs (module docstring, part 3); samples/s in seconds of the assumed GPUs.

    The rollout batch is ``samples_per_gpu`` x G, or (None) what the engine holds at once,
    rounded to a multiple of group_size x trainer GPUs (DDP shards it equally).

    Two reductions keep a run in seconds per mode: one simulated token stands for ``chunk``
    real ones (lengths / chunk; an iteration costs chunk x (a + b running / R)), the same clock
    for a linear iteration cost with ``chunk`` times fewer tokens to carry; and with
    ``slice_gpus`` the run simulates one of n equal slices of about that many GPUs (R / n
    replicas, T / n trainer GPUs, batch / n: the same step time and per-slot load) and
    multiplies its samples/s by n. The sync cost stays the whole system's (R replicas). What a
    slice changes is only how many independent lengths a batch draws."""
    split = gpu_split(model, dist, gpu, prompt_tokens, max_tokens, **(split_kw or {}))
    dec = split["decode"]
    layout = place(gpus, split["engine_share"], dec["tp"], gpu.gpus_per_node)
    r, t = layout["replicas"], layout["trainer_gpus"]
    n = max(1, gpus // slice_gpus) if slice_gpus else 1
    while r % n or t % n:
        n -= 1
    r_s, t_s = r // n, t // n
    concurrency = r_s * dec["batch"]  # one slice's
    unit = math.lcm(group_size, t_s)
    batch = max(unit, unit * ((samples_per_gpu * gpus // n if samples_per_gpu else concurrency) // unit))
    prompts = batch // group_size
    step_s = batch * split["train_gpu_s_per_sample"] / t_s
    link = "ib" if gpus > gpu.gpus_per_node else "nvlink"
    syncs = {h: sync_cost(model, r, dec["tp"], gpu, h, link, fixed_s) for h in sync}
    # bound: the engine full (iteration a + b x batch per token), the trainer at step_s
    full_it = dec["iteration_s"]
    lat_s = [(min(v, max_tokens) * full_it, p) for v, p in dist]
    rows = []
    modes = {}
    for k in staleness:
        modes.update(mode_overrides(k))
    for how, sync_s in syncs.items():
        bound = bounds(lat_s, batch, concurrency, step_s, None, group_size, 1, sync_s)
        for name, overrides in modes.items():
            cfg = pipeline_config(
                [
                    *overrides,
                    f"rollout.prompts_per_step={prompts}",
                    f"rollout.group_size={group_size}",
                    f"rollout.sampling.max_tokens={int(max_tokens // chunk)}",
                ]
            )
            ctl = build(cfg.rollout)
            engine = SimEngine(
                max_concurrency=concurrency, step_cost=(chunk * dec["a_s"], chunk * dec["b_s"] / r_s)
            )
            t0 = time.perf_counter()
            out = simulate(
                ctl,
                [(v / chunk, q) for v, q in dist],
                steps,
                step_s,
                None,
                num_prompts=max(20000, 4 * steps * prompts),
                seed=seed,
                engine=engine,
                sync_time=sync_s,
            )
            trained_groups = out["trained_samples"] / group_size
            dropped = out["dropped_groups"]
            rows.append(
                {
                    "gpus": gpus,
                    "sync": how,
                    "mode": name,
                    "samples_per_s": n * out["samples_per_unit"],
                    "of_pipeline_bound": out["samples_per_unit"] / bound["pipeline_bound_samples_per_unit"],
                    "staleness_mean": out["staleness_mean"],
                    "staleness_p95": out["staleness_p95"],
                    "staleness_max": out["staleness_max"],
                    "trainer_idle_frac": out["trainer_idle_frac"],
                    "engine_utilisation": out["engine_utilisation"],
                    "sync_frac": out["sync_frac"],
                    "drop_rate": dropped / (dropped + trained_groups) if dropped + trained_groups else 0.0,
                    "sim_wall_s": time.perf_counter() - t0,
                }
            )
    return {
        "layout": layout,
        "slices": n,
        "samples_per_step": n * batch,
        "prompts_per_step": n * prompts,
        "group_size": group_size,
        "engine_concurrency": n * concurrency,
        "trainer_step_s": step_s,
        "sync_s": syncs,
        "link": link,
        "decode_iteration_full_s": full_it,
        "pipeline_bound_samples_per_s": {
            h: n
            * bounds(lat_s, batch, concurrency, step_s, None, group_size, 1, s)[
                "pipeline_bound_samples_per_unit"
            ]
            for h, s in syncs.items()
        },
        "rows": rows,
    }
