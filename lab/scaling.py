"""Many nodes, on paper and in the simulator: weight-sync cost, engine/trainer GPU split, and
the pipeline simulator at 64 and 256 GPUs (docs/scaling.md).

    python -m lab.scaling --out outputs/bench/scaling/7b.json    # all of it (~3 min here)
    python -m lab.scaling --no-measure --samples-per-gpu 8 --plot outputs/bench/scaling/7b_batch8.png
    python -m lab.scaling --no-measure --sim-model 70b --plot outputs/bench/scaling/70b.png
    python -m lab.scaling --smoke          # tiny settings (the test; seconds; plot to outputs/)

Three parts, each a transparent formula whose inputs are arguments (``Gpu``, ``Model``, the
keyword defaults), printed as one JSON object (last line) and drawn to ``--plot``
(default ``docs/scaling.png``; with ``--smoke``, ``outputs/bench/scaling/smoke.png``):

1. **Weight-sync cost.** bytes = params x bytes per parameter (bf16: 2). Per-replica push
   (the trainer sends a full copy to each of R replicas over its own link, one after another
   or concurrently, the same bytes): R x (bytes / bandwidth + latency). Pipelined broadcast
   (NCCL; a tree or ring of receivers forwarding chunks): bytes / bandwidth +
   ceil(log2(receivers + 1)) x (latency + chunk / bandwidth), nearly flat in R. Plus a fixed
   cost per sync (pause, prefix-cache reset, resume). Bandwidths are assumptions (``Gpu``); what
   runs here is measured: the shm path's write + read + copy of a bf16 state dict through
   /dev/shm (``SharedMemoryWeightTransfer`` minus the engine), fitted to fixed + bytes / bw.
2. **Engine/trainer split** (``gpu_split``): training costs (3 x epochs + recompute + ref)
   forward passes of 2 N S + 2 layers d_model S^2 FLOPs per sample of S tokens, at ``mfu`` of
   peak; decoding is memory-bound: one iteration of a replica (TP GPUs) reads the weights once
   and each running sequence's KV cache, at ``hbm_eff`` of HBM bandwidth, and the batch is
   what the KV cache holds. The split balances GPU-seconds per sample (the pipeline bound's
   balance, the engine full).
3. **The simulator at scale** (``simulate_scale``): G GPUs -> trainer GPUs (whole nodes) and
   R = engine GPUs / TP replicas; the replicas are one ``SimEngine`` with R x batch slots
   whose decoding iteration costs ``a + b x running / R`` seconds (the least-loaded dispatcher
   keeps them even), so its clock is in seconds; a weight sync pauses it for the cost model's
   time (``tools.pipeline.simulate(sync_time=...)``). Workload: the repo's lognormal
   (``conf/sim/lognormal.yaml``, sigma 1.5) scaled to reasoning lengths, clipped at
   ``max_tokens``. Each mode runs through the real rollout controllers.

Only part of 1 is measured here (2 CPU cores, no GPU); every GPU, NVLink and InfiniBand figure
is an assumption, listed in the JSON under ``assumptions``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from modules.engine.sim import SimEngine
from modules.launch.compose import ROOT, build
from tools.pipeline import bounds, pipeline_config, simulate

GB = 1e9


@dataclass(frozen=True)
class Gpu:
    """Assumed accelerator and interconnect figures (vendor datasheets; effective = a share of
    nominal that NCCL / vLLM typically reach; none measured here)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s (H100/H200 SXM datasheet: 989 TFLOP/s)
    hbm_bytes_per_s: float  # H100 SXM 3.35 TB/s, H200 4.8 TB/s
    memory_bytes: float  # H100 80 GB, H200 141 GB
    nvlink_bytes_per_s: float = 400 * GB  # NVLink 4: 450 GB/s per direction nominal; ~400 effective
    nic_bytes_per_s: float = 40 * GB  # one 400 Gb/s NDR IB NIC = 50 GB/s nominal, 0.8 of it
    nvlink_latency_s: float = 5e-6
    ib_latency_s: float = 10e-6
    gpus_per_node: int = 8


GPUS = {
    "h100": Gpu("H100 SXM 80GB", 989e12, 3.35e12, 80 * GB),
    "h200": Gpu("H200 SXM 141GB", 989e12, 4.8e12, 141 * GB),
}


@dataclass(frozen=True)
class Model:
    """A dense decoder's size and shape (from the public config.json of the named model)."""

    name: str
    params: float
    layers: int
    d_model: int
    kv_heads: int
    head_dim: int = 128

    def weight_bytes(self, bytes_per_param: float = 2.0) -> float:
        return weight_bytes(self.params, bytes_per_param)

    def kv_bytes_per_token(self, bytes_per_value: float = 2.0) -> float:
        """K and V of every layer for one token (bf16 cache)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value


MODELS = {
    "7b": Model("7B (Qwen2.5-7B shape)", 7.62e9, 28, 3584, 4),
    "32b": Model("32B (Qwen2.5-32B shape)", 32.8e9, 64, 5120, 8),
    "70b": Model("70B (Llama-3.1-70B shape)", 70.6e9, 80, 8192, 8),
}

Dist = list[tuple[float, float]]  # [(generated tokens, probability), ...]


# --- 1. weight-sync cost model ----------------------------------------------------------


def weight_bytes(params: float, bytes_per_param: float = 2.0) -> float:
    """Bytes one full copy of the weights moves (bf16: 2 per parameter)."""
    return params * bytes_per_param


def push_time(nbytes: float, replicas: int, bandwidth: float, latency: float = 0.0) -> float:
    """The trainer sends a full copy to each replica over its one link (in turn, or all at
    once sharing the link: the same bytes cross it): R x (bytes / bandwidth + latency)."""
    return replicas * (nbytes / bandwidth + latency)


def broadcast_time(
    nbytes: float, receivers: int, bandwidth: float, latency: float = 0.0, chunk: float = 4 * 2**20
) -> float:
    """Pipelined broadcast (NCCL ring / tree): the message streams through the receivers in
    chunks, every link busy at once, so the bytes cross the slowest link about once; each level
    of a tree of ``receivers + 1`` ranks adds one hop's latency and one chunk's transfer."""
    depth = math.ceil(math.log2(receivers + 1)) if receivers > 0 else 0
    return nbytes / bandwidth + depth * (latency + min(chunk, nbytes) / bandwidth)


def sync_cost(
    model: Model,
    replicas: int,
    tp: int,
    gpu: Gpu,
    how: str = "tree",
    link: str = "ib",
    fixed_s: float = 0.5,
    bytes_per_param: float = 2.0,
) -> float:
    """Seconds per weight sync: ``fixed_s`` (pause, prefix-cache reset, version, resume;
    assumed) + moving the weights from trainer rank 0 to every engine worker. vLLM's NCCL path
    broadcasts whole tensors to every worker of a replica (each keeps its shard), so a tree
    reaches replicas x TP receivers and a push sends one copy per replica (its group's own
    broadcast reaches the TP workers). ``link``: ``nvlink`` (all on rank 0's node) or ``ib`` (a
    receiver on another node: the slowest link, rank 0's one NIC, sets the rate)."""
    bw, lat = (
        (gpu.nvlink_bytes_per_s, gpu.nvlink_latency_s)
        if link == "nvlink"
        else (gpu.nic_bytes_per_s, gpu.ib_latency_s)
    )
    nbytes = model.weight_bytes(bytes_per_param)
    if how == "push":
        return fixed_s + push_time(nbytes, replicas, bw, lat)
    return fixed_s + broadcast_time(nbytes, replicas * tp, bw, lat)


def measure_shm(sizes_mib=(32, 128, 256), tensor_kib=(256, 8192), repeats=3) -> dict:
    """Time the shm weight-sync path without an engine: the sender's safetensors write to
    /dev/shm (``SharedMemoryWeightTransfer.send``) + the receiver's read (``load_file``, as
    ``asyncrl_load_weights``) + the copy into the model's own tensors, for bf16 state dicts of
    ``sizes_mib`` in tensors of ``tensor_kib``; fastest of ``repeats`` (a shared machine).
    Fits seconds = fixed + bytes / bandwidth (least squares), and with a per-tensor term."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from modules.engine.shm_transfer import scratch_dir

    points = []
    for total in sizes_mib:
        for tk in tensor_kib:
            n = max(1, total * 1024 // tk)
            numel = tk * 1024 // 2
            src = {f"layers.{i}.weight": torch.randn(numel, dtype=torch.bfloat16) for i in range(n)}
            dst = {k: torch.empty_like(v) for k, v in src.items()}
            nbytes = n * numel * 2
            times = []
            for _ in range(repeats):
                with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=scratch_dir(nbytes)) as f:
                    t0 = time.perf_counter()
                    save_file(src, f.name)
                    state = load_file(f.name)
                    for k, v in state.items():
                        dst[k].copy_(v)
                    times.append(time.perf_counter() - t0)
                del state
            points.append(
                {"bytes": nbytes, "tensors": n, "seconds": min(times), "median_s": statistics.median(times)}
            )
            del src, dst
    y = np.array([p["seconds"] for p in points])

    def fit(cols: list[str]) -> tuple[np.ndarray, float]:
        x = np.array([[1.0, *(p[c] for c in cols)] for p in points])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        ss = float(((y - y.mean()) ** 2).sum())
        return coef, 1 - float(((y - x @ coef) ** 2).sum()) / ss if ss else 1.0

    (fixed, per_byte), r2 = fit(["bytes"])
    (fixed3, per_byte3, per_tensor), r2_3 = fit(["bytes", "tensors"])
    return {
        "points": points,
        "fixed_s": float(fixed),
        "bandwidth_bytes_per_s": float(1 / per_byte) if per_byte > 0 else float("inf"),
        "r2": r2,
        "with_tensors": {
            "fixed_s": float(fixed3),
            "bandwidth_bytes_per_s": float(1 / per_byte3) if per_byte3 > 0 else float("inf"),
            "per_tensor_s": float(per_tensor),
            "r2": r2_3,
        },
        "scratch": scratch_dir(1) or tempfile.gettempdir(),
    }


# --- 2. engine / trainer split -----------------------------------------------------------


def moments(dist: Dist, prompt_tokens: float, max_tokens: float | None = None) -> dict:
    """E[L], E[S], E[S^2] (S = prompt + generated) and the token-weighted mean context of a
    decoding sequence, prompt + E[L^2] / (2 E[L]) (a long response occupies more iterations)."""
    dist = [(min(v, max_tokens) if max_tokens else v, p) for v, p in dist]
    total = sum(p for _, p in dist)
    e = lambda f: sum(f(v) * p for v, p in dist) / total  # noqa: E731
    mean_l, mean_l2 = e(lambda v: v), e(lambda v: v * v)
    return {
        "mean_generated": mean_l,
        "mean_seq": prompt_tokens + mean_l,
        "mean_seq_sq": e(lambda v: (prompt_tokens + v) ** 2),
        "decode_context": prompt_tokens + mean_l2 / (2 * mean_l),
    }


def default_tp(model: Model, gpu: Gpu, weight_share: float = 0.4) -> int:
    """The smallest power-of-two TP whose GPUs hold the weights in ``weight_share`` of memory
    (the rest is KV cache)."""
    tp = 1
    while model.weight_bytes() > weight_share * tp * gpu.memory_bytes and tp < gpu.gpus_per_node:
        tp *= 2
    return tp


def decode_rate(
    model: Model,
    gpu: Gpu,
    context: float,
    tp: int | None = None,
    hbm_eff: float = 0.7,
    mem_util: float = 0.9,
    max_num_seqs: int = 256,
    overhead_s: float = 0.002,
    decode_mfu: float = 0.5,
) -> dict:
    """One replica of TP GPUs decoding: an iteration over n running sequences costs
    ``a + b n`` seconds, a = the weights' bytes per GPU / (HBM x ``hbm_eff``) + ``overhead_s``,
    b = one sequence's KV bytes per GPU at ``context`` tokens / (HBM x ``hbm_eff``) (or its
    FLOPs at ``decode_mfu`` of peak, if larger). The batch n is what the KV cache holds
    (``mem_util`` of memory less the weights), at most ``max_num_seqs``."""
    tp = tp or default_tp(model, gpu)
    bw = gpu.hbm_bytes_per_s * hbm_eff
    shards = min(tp, model.kv_heads)  # KV heads beyond the TP degree are replicated
    kv_seq_gpu = model.kv_bytes_per_token() / shards * context
    free = mem_util * gpu.memory_bytes - model.weight_bytes() / tp
    if free <= 0:
        raise ValueError(f"{model.name} does not fit on TP={tp} x {gpu.name}")
    batch = max(1, min(max_num_seqs, int(free / kv_seq_gpu)))
    a = model.weight_bytes() / tp / bw + overhead_s
    flops_seq = 2 * model.params + 4 * model.layers * model.d_model * context
    b = max(kv_seq_gpu / bw, flops_seq / tp / (gpu.peak_flops * decode_mfu))
    it = a + b * batch
    return {"tp": tp, "batch": batch, "a_s": a, "b_s": b, "iteration_s": it, "tokens_per_s": batch / it}


def gpu_split(
    model: Model,
    dist: Dist,
    gpu: Gpu,
    prompt_tokens: float = 1024,
    max_tokens: float | None = None,
    tp: int | None = None,
    mfu: float = 0.4,
    epochs: int = 1,
    recompute: float = 1.0,
    ref: float = 0.0,
    prefill_mfu: float = 0.5,
    **decode_kw,
) -> dict:
    """GPU-seconds per sample on each side and the engine share of GPUs that balances them.
    Training a sample of S tokens: (3 x ``epochs`` + ``recompute`` (pi_old) + ``ref`` (a
    reference model)) forward passes of 2 N S + 2 layers d_model S^2 FLOPs, at ``mfu`` of peak.
    Generating it: its tokens at the replica's per-GPU decode rate (``decode_rate`` at the
    token-weighted context) + its prompt's prefill (2 N per token at ``prefill_mfu``)."""
    m = moments(dist, prompt_tokens, max_tokens)
    passes = 3 * epochs + recompute + ref
    flops = passes * (2 * model.params * m["mean_seq"] + 2 * model.layers * model.d_model * m["mean_seq_sq"])
    train_s = flops / (gpu.peak_flops * mfu)
    dec = decode_rate(model, gpu, m["decode_context"], tp, **decode_kw)
    per_gpu = dec["tokens_per_s"] / dec["tp"]
    gen_s = m["mean_generated"] / per_gpu + 2 * model.params * prompt_tokens / (gpu.peak_flops * prefill_mfu)
    return {
        "model": model.name,
        **m,
        "train_flops_per_sample": flops,
        "train_gpu_s_per_sample": train_s,
        "train_tokens_per_s_per_gpu": m["mean_seq"] / train_s,
        "decode": dec,
        "decode_tokens_per_s_per_gpu": per_gpu,
        "gen_gpu_s_per_sample": gen_s,
        "engine_share": gen_s / (gen_s + train_s),
        "engine_per_trainer_gpu": gen_s / train_s,
    }


def place(gpus: int, share: float, tp: int, per_node: int = 8) -> dict:
    """G GPUs -> trainer GPUs (whole nodes when G spans 2+ nodes) and engine replicas of TP."""
    unit = per_node if gpus >= 2 * per_node and gpus % per_node == 0 else 1
    trainer = min(gpus - tp, max(unit, unit * round((1 - share) * gpus / unit)))
    replicas = (gpus - trainer) // tp
    return {
        "gpus": gpus,
        "trainer_gpus": trainer,
        "replicas": replicas,
        "tp": tp,
        "engine_gpus": replicas * tp,
    }


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


# --- report --------------------------------------------------------------------------------


def sync_table(gpu: Gpu, replicas=(1, 2, 4, 8, 16, 32, 64), fixed_s: float = 0.5) -> list[dict]:
    rows = []
    for key, model in MODELS.items():
        tp = default_tp(model, gpu)
        for r in replicas:
            row = {"model": key, "bytes": model.weight_bytes(), "replicas": r, "tp": tp}
            for how in ("tree", "push"):
                for link in ("nvlink", "ib"):
                    row[f"{how}_{link}_s"] = sync_cost(model, r, tp, gpu, how, link, fixed_s)
            rows.append(row)
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    shm = result.get("shm")
    if shm:
        xs = [p["bytes"] / 2**20 for p in shm["points"]]
        ax.scatter(xs, [p["seconds"] for p in shm["points"]], label="measured (fastest of 5)")
        top = max(xs)
        ax.plot(
            [0, top],
            [shm["fixed_s"], shm["fixed_s"] + top * 2**20 / shm["bandwidth_bytes_per_s"]],
            "k--",
            label=f"fit: {shm['fixed_s'] * 1e3:.0f} ms + bytes / {shm['bandwidth_bytes_per_s'] / GB:.2f} GB/s",
        )
        ax.legend(fontsize=8)
    ax.set(xlabel="state dict (MiB, bf16)", ylabel="s", title="shm weight sync on this CPU (measured)")
    ax = axes[1]
    for key, style in (("7b", "-"), ("70b", ":")):
        rows = [r for r in result["sync_model"] if r["model"] == key]
        rs = [r["replicas"] for r in rows]
        for col, label in (("push_ib_s", "push, IB"), ("tree_ib_s", "broadcast, IB")):
            ax.plot(rs, [r[col] for r in rows], style, marker="o", ms=3, label=f"{key} {label}")
        local = [r for r in rows if r["replicas"] * r["tp"] < result["gpu"]["gpus_per_node"]]
        if local:
            ax.plot(
                [r["replicas"] for r in local],
                [r["tree_nvlink_s"] for r in local],
                style,
                marker="o",
                ms=3,
                label=f"{key} broadcast, NVLink (one node)",
            )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="engine replicas R",
        ylabel="s per sync",
        title="weight sync: push vs broadcast (assumed links)",
    )
    ax.legend(fontsize=7)
    ax = axes[2]
    groups = [
        (sim, row["mode"]) for sim in result["simulated"] for row in sim["rows"] if row["sync"] == "tree"
    ]
    for j, how in enumerate(("tree", "push")):
        for i, (sim, mode) in enumerate(groups):
            row = next((r for r in sim["rows"] if r["sync"] == how and r["mode"] == mode), None)
            if row is None:
                continue
            x = i + (j - 0.5) * 0.4
            ax.bar(
                x,
                row["samples_per_s"],
                width=0.4,
                color="C0" if how == "tree" else "C3",
                label=("broadcast sync" if how == "tree" else "per-replica push") if i == 0 else None,
            )
            ax.text(
                x, row["samples_per_s"], f"{row['staleness_mean']:.1f}", ha="center", va="bottom", fontsize=6
            )
    labels = [f"{sim['layout']['gpus']} GPUs\n{mode.replace('streaming ', 'str. ')}" for sim, mode in groups]
    ax.set_xticks(range(len(groups)), labels, fontsize=6)
    ax.set(ylabel="samples/s (predicted)", title=f"simulator, {result['sim_model']}; label: mean staleness")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    p.add_argument("--gpus", type=int, nargs="+", default=[64, 256])
    p.add_argument("--sim-model", default="7b", choices=sorted(MODELS))
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[8192, 16384, 32768],
        help="generated tokens per sample for the ratio table",
    )
    p.add_argument(
        "--scale", type=float, default=200.0, help="lognormal workload x this many tokens (median 20 x)"
    )
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument(
        "--samples-per-gpu",
        type=int,
        default=None,
        help="rollout batch = this x GPUs (default: the engine's slots)",
    )
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--max-staleness", type=int, nargs="+", default=[2, 8])
    p.add_argument("--sync-fixed-s", type=float, default=0.5)
    p.add_argument("--chunk", type=float, default=None, help="real tokens per simulated token (scale / 4)")
    p.add_argument(
        "--slice-gpus",
        type=int,
        default=16,
        help="simulate one slice of about this many GPUs, x n (0: whole)",
    )
    p.add_argument("--no-measure", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny settings: 8 GPUs, 3 steps, 1-4 MiB")
    p.add_argument("--plot", type=Path, default=None, help="PNG path (docs/scaling.png)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    gpu = GPUS[a.gpu]
    if a.smoke:
        a.gpus, a.steps, a.samples_per_gpu, a.max_staleness, a.lengths = [8], 3, 2, [2], [8192]
    if a.plot is None:
        a.plot = ROOT / ("outputs/bench/scaling/smoke.png" if a.smoke else "docs/scaling.png")
    result: dict = {
        "gpu": asdict(gpu),
        "assumptions": {
            "gpu": f"{gpu.name}: {gpu.peak_flops / 1e12:.0f} TFLOP/s bf16 dense, HBM {gpu.hbm_bytes_per_s / 1e12:.2f} TB/s, "
            f"{gpu.memory_bytes / GB:.0f} GB (datasheet)",
            "links": f"NVLink {gpu.nvlink_bytes_per_s / GB:.0f} GB/s effective, IB {gpu.nic_bytes_per_s / GB:.0f} GB/s per NIC "
            "effective (400 Gb/s x 0.8); a sync leaves rank 0's node through one NIC",
            "sync_fixed_s": a.sync_fixed_s,
            "train": "mfu 0.4; 3 x epochs (1) + 1 (pi_old recompute) forward-equivalents; no reference model",
            "decode": "HBM efficiency 0.7, 0.9 of memory for weights + KV, <= 256 sequences per replica, 2 ms per "
            "iteration overhead; KV at the token-weighted mean context; bf16 weights and KV",
            "prompt_tokens": a.prompt_tokens,
        },
    }
    if not a.no_measure:
        sizes = (1, 2, 4) if a.smoke else (32, 128, 256)
        kib = (256, 1024) if a.smoke else (256, 8192)
        result["shm"] = measure_shm(sizes, kib, repeats=2 if a.smoke else 5)
    result["sync_model"] = sync_table(gpu, fixed_s=a.sync_fixed_s)
    result["ratio"] = [
        {
            "length": n,
            **{k: v for k, v in gpu_split(m, [(n, 1.0)], gpu, a.prompt_tokens).items() if k != "model"},
            "key": key,
        }
        for key, m in MODELS.items()
        for n in a.lengths
    ]
    dist = workload(a.scale)
    model = MODELS[a.sim_model]
    result["sim_model"] = model.name
    result["workload"] = {
        "scale": a.scale,
        "max_tokens": a.max_tokens,
        **moments(dist, a.prompt_tokens, a.max_tokens),
        "clipped_share": sum(p for v, p in dist if v >= a.max_tokens),
    }
    result["simulated"] = [
        simulate_scale(
            g,
            model,
            gpu,
            dist,
            a.max_tokens,
            a.prompt_tokens,
            a.group_size,
            a.samples_per_gpu,
            a.steps,
            tuple(a.max_staleness),
            fixed_s=a.sync_fixed_s,
            chunk=a.chunk or a.scale / 4,
            slice_gpus=a.slice_gpus,
        )
        for g in a.gpus
    ]
    plot(result, a.plot)
    result["plot"] = str(a.plot)
    text = json.dumps(result)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
