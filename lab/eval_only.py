"""The held-out evaluation of a recipe's starting model, without training: one JSON line.

    python -m lab.eval_only recipe=smollm2_tools model.path=artifacts/smollm2-135m-instruct

Composes the config as ``train.py`` does (any overrides), starts the engine with ``model.path``
and runs the same evaluation the run's first held-out evaluation would (same prompts, greedy and
sampled passes, per-request seeds, the environment's counters). Used to choose a warm start that
leaves the RL recipe something to teach (lab/README.md, the tool recipe on the real model),
without paying for a training run per candidate.
"""

from __future__ import annotations

import json
import sys
import time


def main(overrides: list[str]) -> dict[str, float]:
    import torch

    from modules.launch.compose import build, compose

    cfg = compose(overrides, output_dir="/tmp/asyncrl-eval-only")
    torch.set_num_threads(cfg.torch_threads)
    dm = build(cfg.data)
    t0 = time.perf_counter()
    dm.setup("fit")  # starts the engine with model.path; no rollout generation
    try:
        started = time.perf_counter()
        out = dm.evaluate()
    finally:
        dm.teardown("fit")
    out["eval_s"] = time.perf_counter() - started
    out["engine_start_s"] = started - t0
    print(json.dumps({"overrides": overrides, **out}, sort_keys=True))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
