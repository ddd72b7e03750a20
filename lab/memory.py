"""Peak trainer memory of one training forward + backward: full logits vs the chunked head,
and the whole minibatch vs checkpointed micro-batches.

    python -m lab.memory                          # vocab 151,936, 4 x 1,024 tokens
    python -m lab.memory --vocab 32000 --tokens 2048 --chunks 512 4096
    python -m lab.memory --vocab 8192 --hidden 512 --layers 8 --rows 8 --micro 1 2

Each configuration runs in a fresh process (peak RSS is per process): a tiny Qwen2 trunk
(hidden 64, 2 layers) with a large vocabulary, so the output head and its logits dominate as
they do for a 1.5B model at long context; ``logit_chunk`` null vs each ``--chunks`` value.
``--micro M...`` adds, for each M, the last ``--chunks`` head with ``algo.micro_batch_size=M``
(``modules/policy/microbatch.py``); ``--grad-ckpt`` adds ``module.gradient_checkpointing=true`` (alone
and with the smallest M). A wider, deeper trunk (``--hidden``, ``--layers``) makes the trunk's
activations, which both cut, the larger part.
Prints one JSON line per configuration and a summary (peak RSS above the model's, MiB).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def measure(
    vocab: int,
    rows: int,
    tokens: int,
    chunk: int | None,
    micro: int | None,
    hidden: int,
    layers: int,
    grad_ckpt: bool = False,
) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from modules.policy.microbatch import MicroBatched
    from modules.policy.packing import PaddedForward

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(cfg).train()
    if grad_ckpt:  # module.gradient_checkpointing=true
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ids = torch.randint(3, vocab, (rows, tokens))
    mask = torch.ones_like(ids)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    forward = PaddedForward(logit_chunk=chunk)
    logp, _ = (forward if micro is None else MicroBatched(forward, micro))(model, ids, mask, 1.0, True)
    logp.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "logit_chunk": chunk,
        "micro_batch_size": micro,
        "gradient_checkpointing": grad_ckpt,
        "vocab": vocab,
        "hidden": hidden,
        "layers": layers,
        "tokens": rows * tokens,
        "peak_mib_above_model": peak - base,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024])
    parser.add_argument("--micro", type=int, nargs="*", default=[], help="micro-batch sizes (sequences)")
    parser.add_argument(
        "--grad-ckpt", action="store_true", help="add the last config with trunk checkpointing"
    )
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--one", type=str, help=argparse.SUPPRESS)  # internal: one measurement
    args = parser.parse_args()
    shape = {"vocab": args.vocab, "rows": args.rows, "tokens": args.tokens}
    shape.update(hidden=args.hidden, layers=args.layers)
    if args.one is not None:
        chunk, micro, ckpt = args.one.split(",")
        chunk, micro = (None if x == "null" else int(x) for x in (chunk, micro))
        print(json.dumps(measure(chunk=chunk, micro=micro, grad_ckpt=ckpt == "1", **shape)))
        return
    configs = [(None, None, 0), *((c, None, 0) for c in args.chunks)]
    configs += [(args.chunks[-1], m, 0) for m in args.micro]
    if args.grad_ckpt:
        configs += [(args.chunks[-1], None, 1)] + [(args.chunks[-1], min(args.micro), 1)] * bool(args.micro)
    results = []
    for chunk, micro, ckpt in configs:
        one = ",".join("null" if x is None else str(x) for x in (chunk, micro, ckpt))
        cmd = [sys.executable, "-m", "lab.memory", "--one", one]
        cmd += [arg for k, v in shape.items() for arg in (f"--{k}", str(v))]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]))

    def name(r: dict) -> str:
        ckpt = ",grad_ckpt" if r["gradient_checkpointing"] else ""
        return f"chunk={r['logit_chunk']},micro={r['micro_batch_size']}{ckpt}"

    full = results[0]["peak_mib_above_model"]
    print(
        json.dumps(
            {
                "summary": {name(r): round(r["peak_mib_above_model"]) for r in results},
                "reduction": {
                    name(r): round(full / max(r["peak_mib_above_model"], 1e-9), 1) for r in results[1:]
                },
            }
        )
    )


if __name__ == "__main__":
    main()
