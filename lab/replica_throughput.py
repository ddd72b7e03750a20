"""Rollout replicas on this machine: generation throughput and weight-sync time, 1 vs R engines.

    python -m lab.replica_throughput                          # 1 engine on core 1 vs 2 on cores 0-1
    python -m lab.replica_throughput --rounds 3 --requests 128 --tokens 64 --hidden 256

Each round starts the configurations in turn (interleaved, so drift in this shared machine's
speed hits both) and times the same fixed workload: ``--requests`` prompts of distinct text,
each generating exactly ``--tokens`` tokens (``ignore_eos``), all submitted at once through the
``Engine`` interface the controllers use, then ``--syncs`` weight updates of the same model.
The model is a random Qwen2 built here (``modules/policy/tiny_model.py``), bigger than the tests' so
that compute, not per-step Python, dominates. No trainer runs meanwhile: R = 2 on a 2-core
machine gives each engine a whole core, while the dispatcher and the callback thread share
them, so the gain is bounded by 2x and reduced by that sharing.

Prints one JSON object: per configuration, tokens/s and sync seconds (mean, spread over rounds),
and the throughput ratio R vs 1 with a 95 % t interval over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lab.bench_metrics import mean_ci
from modules.engine import SamplingConfig
from modules.engine.replicas import build_engine
from modules.policy.tiny_model import build_tiny_qwen


def run_once(model: Path, replicas: int, cores: str, requests: int, tokens: int, syncs: int) -> dict:
    eng = build_engine(
        model_path=str(model),
        replicas=replicas,
        cpu_cores=cores,
        pin_trainer=False,
        max_model_len=tokens + 32,
        max_num_seqs=256,
    ).start()
    try:
        sampling = SamplingConfig(max_tokens=tokens, ignore_eos=True)
        eng.wait_result(eng.submit([5, 6, 7], SamplingConfig(max_tokens=4)), timeout=120)  # warm
        t0 = time.perf_counter()
        futs = [eng.submit([5 + i % 50, 6 + i % 7, 7 + i % 11, 8], sampling, seed=i) for i in range(requests)]
        done = sum(len(eng.wait_result(f, timeout=600).token_ids) for f in futs)
        gen_s = time.perf_counter() - t0
        from modules.policy.hf_policy import load_policy, named_weights

        weights = named_weights(load_policy(model)[0])
        sync_s = [eng.update_weights(weights, v + 1) for v in range(syncs)]
        return {"tokens_per_s": done / gen_s, "sync_s": statistics.median(sync_s)}
    finally:
        eng.shutdown()


def summary(xs: list[float]) -> dict:
    """Mean, std and 95 % t interval over rounds (``lab.bench_metrics.mean_ci``)."""
    ci = mean_ci(xs)
    return {k: ci[k] for k in ("mean", "std", "lo", "hi", "n")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--cores", default="0-1", help="cores the R replicas split")
    args = ap.parse_args()
    torch.set_num_threads(1)
    configs = {
        "1 replica (core 1)": (1, "1"),
        f"{args.replicas} replicas ({args.cores})": (args.replicas, args.cores),
    }
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_qwen(
            Path(tmp) / "m",
            seed=0,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=3 * args.hidden,
        )
        for _ in range(args.rounds):
            got = {
                k: run_once(model, r, c, args.requests, args.tokens, args.syncs)
                for k, (r, c) in configs.items()
            }
            for k, v in got.items():
                runs[k].append(v)
            one, many = (got[k]["tokens_per_s"] for k in configs)
            ratios.append(many / one)
    out = {
        "workload": vars(args),
        "configs": {
            k: {
                "tokens_per_s": summary([r["tokens_per_s"] for r in v]),
                "sync_s": summary([r["sync_s"] for r in v]),
            }
            for k, v in runs.items()
        },
        "throughput_ratio": summary(ratios),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
