"""The held-out evaluation of a recipe's starting model, without training: one JSON line.

    python -m lab.eval_only recipe=smollm2_tools model.path=artifacts/smollm2-135m-instruct

Composes the config and runs the start-up checks as ``train.py`` does (any overrides; a bad
value is refused naming its field), starts the engine with ``model.path``
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
    from modules.launch.compose import compose
    from modules.launch.start import build_run

    cfg = compose(overrides, output_dir="/tmp/asyncrl-eval-only")
    dm, _, _ = build_run(cfg)  # every start-up check train.py runs; module and trainer unused
    t0 = time.perf_counter()
    try:
        dm.setup("fit")  # starts the engine with model.path; no rollout generation
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
