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
from dataclasses import asdict
from pathlib import Path

from lab.scaling_costs import GB, GPUS, MODELS, gpu_split, moments
from lab.scaling_report import plot, sync_table
from lab.scaling_shm import measure_shm
from lab.scaling_sim import simulate_scale, workload
from modules.launch.compose import ROOT


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
