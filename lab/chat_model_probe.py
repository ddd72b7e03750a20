"""The imported chat model before any training: held-out accuracy of a few prompt variants
(greedy and sampled, through the chat template), and how far a bf16 engine's logprobs sit from
the float32 trainer's on the same samples.

    python -m lab.chat_model_probe                       # accuracy per variant, T = 0 and 1
    python -m lab.chat_model_probe --temperature 0.7 --system ""
    python -m lab.chat_model_probe --gap                 # bf16 engine vs float32 trainer

The numbers in lab/README.md ("A real pretrained chat model on this CPU") came from this code
(run as a scratch script before it moved here). Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from data.tasks.word_problems import WordProblemsTask, final_number
from modules.engine import SamplingConfig
from modules.engine.vllm import VLLMEngine
from modules.policy.hf_policy import load_policy, token_logprobs
from modules.policy.prompt_format import ChatTemplate

MODEL = "artifacts/smollm2-135m-instruct"
ASK = "Answer with the final number."


def variants(n: int = 40, seed: int = 5) -> dict[str, list[tuple[str, int]]]:
    """Question templates by difficulty (the word-problem task's levels and two harder ones)."""
    rng = random.Random(seed)
    pairs = lambda lo, hi, lo2, hi2: [(rng.randint(lo, hi), rng.randint(lo2, hi2)) for _ in range(n)]  # noqa: E731
    found = "Mia has {a} apples and finds {b} more. How many apples does Mia have now? " + ASK
    boxes = "Leo buys {a} boxes with {b} pens in each box. How many pens does Leo have? " + ASK
    return {
        "sum_1d": [(found.format(a=a, b=b), a + b) for a, b in pairs(2, 9, 2, 9)],
        "sum_2d_1d": [(found.format(a=a, b=b), a + b) for a, b in pairs(11, 89, 2, 9)],
        "sum_2d": [(found.format(a=a, b=b), a + b) for a, b in pairs(11, 89, 11, 89)],
        "product_small": [(boxes.format(a=a, b=b), a * b) for a, b in pairs(2, 5, 2, 5)],
        "plain_sum_2d": [
            (f"What is {a} + {b}? Answer with just the number.", a + b) for a, b in pairs(11, 89, 11, 89)
        ],
    }


def accuracy(
    engine: VLLMEngine, tok: object, fmt: ChatTemplate, temperatures: list[float], max_tokens: int
) -> None:
    for name, rows in variants().items():
        for temperature in temperatures:
            n = 1 if temperature == 0 else 4
            sampling = SamplingConfig(temperature=temperature, max_tokens=max_tokens)
            futs = [(a, engine.submit(fmt.ids(tok, q), sampling, seed=k)) for q, a in rows for k in range(n)]
            outs = [(a, engine.wait_result(f)) for a, f in futs]
            right = [
                final_number(tok.decode(c.token_ids, skip_special_tokens=True)) == str(a) for a, c in outs
            ]
            line = {"variant": name, "temperature": temperature, "accuracy": sum(right) / len(right)}
            line["truncated"] = sum(c.finish_reason == "length" for _, c in outs) / len(outs)
            line["mean_len"] = sum(len(c.token_ids) for _, c in outs) / len(outs)
            print(json.dumps(line), flush=True)


def gap(engine: VLLMEngine, tok: object, fmt: ChatTemplate, temperature: float, n: int) -> None:
    """Per-sample max and per-token mean |engine - trainer| logprob, the trainer in float32."""
    model, _ = load_policy(MODEL)
    model.eval()
    task = WordProblemsTask()
    maxes, means = [], []
    for i, row in enumerate(task.build("eval", n)):
        sampling = SamplingConfig(temperature=temperature, max_tokens=64)
        c = engine.wait_result(engine.submit(fmt.ids(tok, task.prompt_text(row)), sampling, seed=i))
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature)
        d = (lp[0, len(c.prompt_ids) - 1 :] - torch.tensor(c.logprobs)).abs()
        maxes.append(float(d.max()))
        means.append(float(d.mean()))
    print(
        json.dumps(
            {
                "engine": engine.dtype,
                "samples": n,
                "max_per_sample": sorted(maxes),
                "mean_per_token": sum(means) / n,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--system", default=None, help="the system turn (default: the template's)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--gap", action="store_true", help="bf16 engine vs float32 trainer logprobs")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    fmt = ChatTemplate(system=args.system)
    dtype = "bfloat16"
    engine = VLLMEngine(
        MODEL, dtype=dtype, max_model_len=256, chunked_prefill=False, pin_trainer=False
    ).start()
    try:
        if args.gap:
            gap(engine, tok, fmt, 0.7, 24)
        else:
            accuracy(engine, tok, fmt, args.temperature, args.max_tokens)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
