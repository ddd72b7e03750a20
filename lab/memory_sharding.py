"""Memory per rank, DDP vs FSDP2 (``modules/policy/sharding.py``), 2 gloo ranks on the CPU.

    .venv/bin/python -m lab.memory_sharding                       # ~57M-parameter Qwen2
    .venv/bin/python -m lab.memory_sharding --hidden 512 --layers 4   # smaller, faster

A randomly initialised Qwen2-style model (nothing is downloaded), float32, AdamW, one training
step on 2 x 64 tokens per rank, the layout the trainer uses: one FSDP2 unit per decoder layer
plus the root, ``reshard_after_forward=False``, gathered at the step's start (``unshard``).
Per rank it reports the bytes of parameters, gradients and optimizer state the rank holds
after the step (exact, from the tensors: a DTensor counts its local shard), DDP's gradient
buckets (a second gradient-sized buffer), and the process's peak RSS above its RSS before the
model was built (the transient full copy of the parameters during forward / backward under
FSDP; activations; allocator slack). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
MB = 2**20


def build(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 192),
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg)


def tensor_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def rank_main(rank: int, store: str, out: str, strategy: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    from modules.policy.sharding import shard_model, unshard

    rss0 = psutil.Process().memory_info().rss
    model = build(args)
    n_params = sum(p.numel() for p in model.parameters())
    buckets = 0
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        shard_model(model, init_device_mesh("cpu", (WORLD,)))
        net = model
    else:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (2, 64), generator=torch.Generator().manual_seed(rank))
    if strategy == "fsdp":
        unshard(model)  # what PolicyGradientModule.training_step does under FSDP
    net(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    if strategy == "ddp":
        buckets = sum(b.buffer().numel() * b.buffer().element_size() for b in _buckets(net))
    params = list(model.parameters())
    state = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
    row = {
        "params_mb": tensor_bytes(params) / MB,
        "grads_mb": tensor_bytes(p.grad for p in params if p.grad is not None) / MB,
        "optimizer_mb": tensor_bytes(state) / MB,
        "ddp_grad_buckets_mb": buckets / MB,
        "peak_rss_above_start_mb": (peak - rss0) / MB,
    }
    row["held_mb"] = row["params_mb"] + row["grads_mb"] + row["optimizer_mb"] + row["ddp_grad_buckets_mb"]
    rows = [None] * WORLD
    dist.all_gather_object(rows, {k: round(v, 1) for k, v in row.items()})
    if rank == 0:
        torch.save({"params": n_params, "ranks": rows}, out)
    dist.destroy_process_group()


def _buckets(net) -> list:
    """DDP's gradient buckets (the reducer's flat buffers), when this torch exposes them."""
    try:
        return list(net.reducer._get_zeros_like_grad_buckets())
    except (AttributeError, RuntimeError):
        return []


def measure(strategy: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        mp.spawn(rank_main, args=(os.path.join(tmp, "store"), out, strategy, args), nprocs=WORLD)
        return torch.load(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    args = p.parse_args()
    result = {"world": WORLD, "dtype": "float32", "optimizer": "AdamW"}
    for strategy in ("ddp", "fsdp"):
        got = measure(strategy, args)
        result["params"] = got["params"]
        result[strategy] = got["ranks"]
    result["held_ratio_fsdp_over_ddp"] = round(result["fsdp"][0]["held_mb"] / result["ddp"][0]["held_mb"], 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
