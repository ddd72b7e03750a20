"""Peak trainer memory of one training forward + backward: full logits vs the chunked head.

    python -m benchmarks.memory                          # vocab 151,936, 4 x 1,024 tokens
    python -m benchmarks.memory --vocab 32000 --tokens 2048 --chunks 512 4096

Each configuration runs in a fresh process (peak RSS is per process): a tiny Qwen2 trunk
(hidden 64, 2 layers) with a large vocabulary, so the output head and its logits dominate as
they do for a 1.5B model at long context; ``logit_chunk`` null vs each ``--chunks`` value.
Prints one JSON line per configuration and a summary (peak RSS above the model's, MiB).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def measure(vocab: int, rows: int, tokens: int, chunk: int | None) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from modules.packing import PaddedForward

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(cfg).train()
    ids = torch.randint(3, vocab, (rows, tokens))
    mask = torch.ones_like(ids)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    logp, _ = PaddedForward(logit_chunk=chunk)(model, ids, mask, 1.0, True)
    logp.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "logit_chunk": chunk,
        "vocab": vocab,
        "tokens": rows * tokens,
        "peak_mib_above_model": peak - base,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024])
    parser.add_argument("--one", type=str, help=argparse.SUPPRESS)  # internal: one measurement
    args = parser.parse_args()
    if args.one is not None:
        chunk = None if args.one == "null" else int(args.one)
        print(json.dumps(measure(args.vocab, args.rows, args.tokens, chunk)))
        return
    results = []
    for chunk in [None, *args.chunks]:
        cmd = [sys.executable, "-m", "benchmarks.memory", "--one", "null" if chunk is None else str(chunk)]
        cmd += ["--vocab", str(args.vocab), "--rows", str(args.rows), "--tokens", str(args.tokens)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]))
    full = results[0]["peak_mib_above_model"]
    print(
        json.dumps(
            {
                "summary": {str(r["logit_chunk"]): round(r["peak_mib_above_model"]) for r in results},
                "reduction": {
                    str(r["logit_chunk"]): round(full / max(r["peak_mib_above_model"], 1e-9), 1)
                    for r in results[1:]
                },
            }
        )
    )


if __name__ == "__main__":
    main()
