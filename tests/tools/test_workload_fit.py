"""The simulator's engine cost model and the planner's fit to a finished run (tools/workload.py)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from modules.engine.sim import CharTokenizer, SimEngine
from modules.engine.types import SamplingConfig
from tools.plan import predict, validate
from tools.workload import Workload, fit, fit_engine, fit_trainer, mean_concurrency

TOK = CharTokenizer()


def submit(eng: SimEngine, lengths: str, rid: str, max_tokens: int = 10_000):
    return eng.submit(TOK(f"{lengths}|")["input_ids"], SamplingConfig(max_tokens=max_tokens), request_id=rid)


def test_mean_concurrency_of_overlapping_intervals():
    starts = [0.0, 0.0, 5.0]
    ends = [10.0, 5.0, 10.0]
    got = mean_concurrency(np.array(starts), np.array(ends))
    assert got == pytest.approx([2.0, 2.0, 2.0])  # always two open in each interval
    got = mean_concurrency(np.array([0.0, 2.0]), np.array([4.0, 3.0]))
    assert got == pytest.approx([1.25, 2.0])
    # over iterations (a + b n each): the busy second holds 1/2 iteration, the 3 others 1 each
    got = mean_concurrency(np.array([0.0, 2.0]), np.array([4.0, 3.0]), cost=(0.0 + 1e-12, 1.0))
    assert got[0] == pytest.approx((3 * 1 + 0.5 * 2) / 3.5)


def simulated_records(a: float, b: float, k: float, seed: int = 0, slowdown: float = 1.0) -> list[dict]:
    """Requests of random lengths arriving in waves on a SimEngine with a known cost model."""
    rng = random.Random(seed)
    eng = SimEngine(step_cost=(a, b), prefill_iterations=k)
    eng.slowdown = slowdown
    records, futs = [], {}
    gid = 0
    for _wave in range(30):
        for _ in range(rng.randint(4, 24)):
            n = rng.choice([3, 5, 8, 20, 40, 90])
            futs[submit(eng, str(n), f"g{gid}-s0")] = gid
            gid += 1
        eng.advance_to(eng.now + rng.uniform(5, 60))
    while any(not f.done() for f in futs):
        eng.advance()
    for f, g in futs.items():
        r = f.result()
        records.append(
            {
                "group": g,
                "sample": 0,
                "level": 0,
                "len": len(r.token_ids),
                "splits": 0,
                "gen_start": r.start_time,
                "gen_end": r.end_time,
            }
        )
    return records


@pytest.mark.parametrize("a,b,k", [(0.02, 0.004, 6), (0.05, 0.0, 0)])
def test_engine_fit_recovers_a_known_cost_model(a, b, k):
    (fa, fb), fk, e, diag = fit_engine(simulated_records(a, b, k))
    assert e == 0.0  # one kind of run: no contention to fit
    # the records hold every request the engine ran, so the fixed point is exact
    assert fa == pytest.approx(a, rel=0.01)
    assert fb == pytest.approx(b, rel=0.01, abs=1e-6)
    assert fk == k
    assert diag["r2"] > 0.999


def test_contention_is_fitted_from_runs_that_shared_the_machine_and_runs_that_did_not():
    alone = simulated_records(0.02, 0.004, 6, seed=0)
    shared = simulated_records(0.02, 0.004, 6, seed=1, slowdown=1.5)  # the trainer busy all along
    for r in shared:
        r["group"] += 10_000  # another run, over the same stretch of time as the first
    u = np.array([0.0] * len(alone) + [1.0] * len(shared))
    runs = np.array([0] * len(alone) + [1] * len(shared))
    (a, b), k, e, _ = fit_engine(alone + shared, u, runs)
    assert (a, b, k) == pytest.approx((0.02, 0.004, 6), rel=0.01)
    assert e == pytest.approx(0.5)
    t0, t = fit_trainer([2.0, 2.0 * 1.3], [0.0, 1.0])
    assert (t0, t) == pytest.approx((2.0, 0.3))
    assert fit_trainer([2.0, 2.2], [0.9, 0.9]) == pytest.approx((2.1, 0.0))
    # two async runs only: too little spread in v to extrapolate, and a downward slope is noise
    assert fit_trainer([1.63, 2.12], [0.99, 0.93]) == pytest.approx((1.875, 0.0))
    assert fit_trainer([2.5, 2.0], [0.0, 1.0]) == pytest.approx((2.25, 0.0))


def test_a_shared_machine_slows_both_sides_in_the_simulator():
    fixed = Workload(groups=[(0, [50] * 8)], step_cost=(0.01, 0.0), prefill_iterations=0, step_time=1.0)
    fast = predict(fixed, ["recipe=async_grpo"], steps=20)
    fixed.contention = (0.5, 0.3)
    slow = predict(fixed, ["recipe=async_grpo"], steps=20)
    assert slow["samples_per_unit"] < 0.9 * fast["samples_per_unit"]
    # sync never overlaps the two: contention changes nothing
    sync = predict(fixed, ["recipe=sync_grpo"], steps=10)["samples_per_unit"]
    assert sync == pytest.approx(128 / (50 * 0.01 + 1.0), rel=0.01)


def test_fit_reads_a_run_and_predicts_sync_throughput(tmp_path):
    """A run directory with records, step times and overrides: the fit's sync prediction is
    the analytical one (a batch of fixed-length groups: request cost + L iterations + the step)."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- recipe=sync_grpo\n- seed=0\n")
    recs = simulated_records(0.01, 0.001, 4)
    with open(run / "experiences.jsonl", "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    rows = ["step,perf/step_s,perf/step_wait_s,perf/samples_per_s"] + [
        f"{i},{2.5 + 1.0},2.5,20.0" for i in range(10)
    ]
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    work = fit(run)
    assert work.step_time == pytest.approx(1.0)
    assert work.overrides == ["recipe=sync_grpo", "seed=0"]

    fixed = Workload(groups=[(0, [50] * 8)], step_cost=(0.01, 0.0), prefill_iterations=4, step_time=1.0)
    out = predict(fixed, ["recipe=sync_grpo"], steps=10)
    per_step = (4 + 50) * 0.01 + 1.0  # 16 x 8 requests all run at once (max_num_seqs 256)
    assert out["samples_per_unit"] == pytest.approx(128 / per_step, rel=0.01)

    # two minibatches: one rollout batch per two optimizer steps, each step fitted at 1.0 s
    two = predict(fixed, ["recipe=sync_grpo", "algo.minibatches=2"], steps=10)
    assert two["trained_samples"] == 5 * 128
    assert two["samples_per_unit"] == pytest.approx(128 / ((4 + 50) * 0.01 + 2 * 1.0), rel=0.01)

    (row,) = validate(fixed, [run])
    assert row["measured_samples_per_s"] == 20.0 and row["runs"] == 1
    assert row["error"] == pytest.approx(row["predicted_samples_per_s"] / 20.0 - 1)
