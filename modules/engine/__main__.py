"""Smoke-test a vLLM engine on a model directory: 32 samples of a remainder prompt.

python -m modules.engine artifacts/tiny-qwen-sft
"""

from __future__ import annotations

import sys
import time

from transformers import AutoTokenizer

from modules.engine.types import SamplingConfig
from modules.engine.vllm import VLLMEngine


def main(path: str) -> None:
    tok = AutoTokenizer.from_pretrained(path)
    engine = VLLMEngine(path).start()
    try:
        t0 = time.time()
        sampling = SamplingConfig(max_tokens=64)
        futs = [engine.submit(tok("12%5=")["input_ids"], sampling, seed=i) for i in range(32)]
        outs = [engine.wait_result(f) for f in futs]
        n = sum(len(o.token_ids) for o in outs)
        print(f"{n} tokens in {time.time() - t0:.2f} s; sample: {tok.decode(outs[0].token_ids)!r}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
