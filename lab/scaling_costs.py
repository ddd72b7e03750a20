"""The formulas of ``lab.scaling`` (docs/scaling.md), parts 1 and 2: the assumed GPUs and models,
the weight-sync cost of push vs pipelined broadcast, and the engine/trainer GPU split.

Imported by ``lab.scaling`` (run that: ``python -m lab.scaling ...``) and ``lab.scaling_sim``;
the formulas are described in ``lab.scaling``'s docstring. Pure arithmetic: every figure is an
argument (``Gpu``, ``Model``, keyword defaults), nothing is measured here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
