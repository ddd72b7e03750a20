"""LoRA against full fine-tuning: trainer memory, step time, and weight-sync time to the engine.

    .venv/bin/python -m lab.lora_memory                                  # ~57M-parameter Qwen2
    .venv/bin/python -m lab.lora_memory --hidden 256 --layers 2 --syncs 3   # small, quick

A Qwen2-style model with the project's tokenizer (``modules.policy.tiny_model``, nothing downloaded),
float32, AdamW, built the way the trainer builds its policy (``modules.policy.hf_policy.build_policy``).
For full fine-tuning and each LoRA rank, in a fresh process each: the bytes of parameters,
gradients and optimizer state held after one step (exact, from the tensors), the peak RSS
above the RSS before the model was built, and the median time of a training step (forward +
backward + AdamW on B x T tokens). Then one real vLLM engine serves the model and each
variant's weights are pushed ``--syncs`` times (variants interleaved): the time to produce
the tensors the engine is sent (LoRA: merged W + scaling * B A, ``modules.policy.lora.merged_weights``)
and the engine's ``update_weights`` (pause, shm load, resume). LoRA pushes the same bytes as full fine-tuning
(merged weights, not adapters), so its sync costs what full fine-tuning's does plus the merge.

Prints one JSON object and saves ``lora.png`` beside ``--out``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch
import torch.multiprocessing as mp

MB = 2**20


def tensor_mb(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / MB


def train_side(path: str, rank: int, args: argparse.Namespace, queue) -> None:
    """One variant in its own process: memory held, peak RSS, step time, merge time."""
    torch.set_num_threads(args.threads)
    from modules.policy.hf_policy import build_policy, named_weights, token_logprobs
    from modules.policy.lora import LoRA

    rss0 = psutil.Process().memory_info().rss
    policy, _ = build_policy(path, lora=LoRA(rank=rank) if rank else None)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, policy.config.vocab_size, (args.batch, args.tokens), generator=gen)
    mask = torch.ones_like(ids)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        logp, _ = token_logprobs(policy, ids, mask)
        (-logp.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    params = list(policy.parameters())
    state = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
    merge = []
    for _ in range(3):
        t0 = time.perf_counter()
        weights = named_weights(policy)
        merge.append(time.perf_counter() - t0)
    row = {
        "trainable_params": sum(p.numel() for p in trainable),
        "params_mb": tensor_mb(params),
        "grads_mb": tensor_mb(p.grad for p in params if p.grad is not None),
        "optimizer_mb": tensor_mb(state),
        "peak_rss_above_start_mb": (peak - rss0) / MB,
        "step_s_median": statistics.median(times[1:] or times),
        "weights_for_engine_s_median": statistics.median(merge),
        "pushed_mb": tensor_mb(weights.values()),
    }
    row["held_mb"] = row["params_mb"] + row["grads_mb"] + row["optimizer_mb"]
    queue.put({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})


def measure_training(path: str, rank: int, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=train_side, args=(path, rank, args, queue))
    proc.start()
    row = queue.get(timeout=1800)
    proc.join()
    return row


def measure_syncs(path: str, ranks: list[int], args: argparse.Namespace) -> dict[int, dict]:
    """One engine; each variant's weights (adapters random, as after training) pushed
    ``--syncs`` times, the variants interleaved round by round so machine noise hits all alike."""
    from modules.engine.vllm import VLLMEngine
    from modules.policy.hf_policy import build_policy, named_weights
    from modules.policy.lora import LoRA

    policies = {}
    for rank in ranks:
        policy, _ = build_policy(path, lora=LoRA(rank=rank) if rank else None)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.01)
        policies[rank] = policy
    engine = VLLMEngine(path, max_model_len=256, max_num_seqs=8, pin_trainer=False).start()
    total: dict[int, list[float]] = {r: [] for r in ranks}
    load: dict[int, list[float]] = {r: [] for r in ranks}
    try:
        for _ in range(args.syncs):
            for rank, policy in policies.items():
                t0 = time.perf_counter()
                weights = named_weights(policy)
                load[rank].append(engine.update_weights(weights, engine.version + 1))
                total[rank].append(time.perf_counter() - t0)
                del weights
    finally:
        engine.shutdown()
    return {
        r: {
            "sync_s_median": round(statistics.median(total[r]), 4),
            "engine_update_s_median": round(statistics.median(load[r]), 4),
        }
        for r in ranks
    }


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["variants"])
    rows = [result["variants"][n] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, title in (
        (axes[0], "held_mb", "params + grads + AdamW (MB)"),
        (axes[1], "step_s_median", "training step (s)"),
        (axes[2], "sync_s_median", "weight sync incl. merge (s)"),
    ):
        ax.bar(names, [r.get(key, 0) for r in rows], color=["tab:gray"] + ["tab:blue"] * (len(names) - 1))
        ax.set_title(title)
    fig.suptitle(f"LoRA vs full fine-tuning, {result['params'] / 1e6:.1f}M params, float32")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--syncs", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="outputs/bench/lora/lora.json")
    args = p.parse_args()
    from modules.policy.tiny_model import build_tiny_qwen

    with tempfile.TemporaryDirectory() as tmp:
        heads = max(1, args.hidden // 64)
        path = str(
            build_tiny_qwen(
                Path(tmp) / "model",
                hidden_size=args.hidden,
                num_layers=args.layers,
                num_heads=heads,
                num_kv_heads=max(1, heads // 3) if heads % 3 == 0 else 1,
                intermediate_size=args.hidden * 8 // 3,
            )
        )
        variants = {"full": 0, **{f"lora_r{r}": r for r in args.ranks}}
        rows = {name: measure_training(path, rank, args) for name, rank in variants.items()}
        syncs = measure_syncs(path, list(variants.values()), args)
    for name, rank in variants.items():
        rows[name].update(syncs[rank])
    full = rows["full"]
    result = {
        "params": full["trainable_params"],
        "dtype": "float32",
        "optimizer": "AdamW",
        "tokens_per_step": args.batch * args.tokens,
        "variants": rows,
        "ratios_to_full": {
            name: {
                k: round(r[k] / full[k], 3)
                for k in ("held_mb", "peak_rss_above_start_mb", "step_s_median", "sync_s_median")
            }
            for name, r in rows.items()
            if name != "full"
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
