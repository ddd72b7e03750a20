"""The simulator's engine cost model and the planner's fit to a finished run (tools/workload.py)."""

from __future__ import annotations

import pytest

from modules.engine.sim import CharTokenizer, SimEngine, SimTask
from modules.engine.types import SamplingConfig

TOK = CharTokenizer()


def submit(eng: SimEngine, lengths: str, rid: str, max_tokens: int = 10_000):
    return eng.submit(TOK(f"{lengths}|")["input_ids"], SamplingConfig(max_tokens=max_tokens), request_id=rid)


def test_iteration_cost_grows_with_the_batch():
    a, b, k = 0.5, 0.25, 2
    eng = SimEngine(step_cost=(a, b), prefill_iterations=k)
    short, long = submit(eng, "4", "g0-s0"), submit(eng, "10", "g1-s0")
    eng.wait_any({short})
    # 2 running: each iteration a + 2b = 1.0; the short one waits k iterations, then 4 tokens
    assert short.result().end_time == pytest.approx((k + 4) * (a + 2 * b))
    eng.wait_any({long})
    # then alone: a + b = 0.75 per iteration for the remaining 6 tokens
    assert long.result().end_time == pytest.approx((k + 4) * (a + 2 * b) + 6 * (a + b))
    assert len(long.result().token_ids) == 10


def test_default_cost_is_one_unit_per_token_and_abort_counts_tokens_by_the_token_clock():
    eng = SimEngine()
    fut = submit(eng, "30", "g0-s0")
    eng.advance_to(12.0)
    eng.update_weights({}, 1, inflight="abort")
    assert len(fut.result().token_ids) == 12 and fut.result().finish_reason == "abort"

    slow = SimEngine(step_cost=(2.0, 0.0))
    fut = submit(slow, "30", "g0-s0")
    slow.advance_to(12.0)  # 6 iterations of 2 units
    slow.update_weights({}, 1, inflight="keep")
    slow.wait_any({fut})
    spans = fut.result().version_spans
    assert spans == [(0, 0, 6), (1, 6, 30)]
    assert fut.result().end_time == pytest.approx(60.0)


def test_a_prompt_can_carry_one_length_per_sample():
    eng = SimEngine()
    futs = [submit(eng, "3,7,5", f"g4-s{i}") for i in range(4)]
    eng.wait_any(set(futs))
    while not all(f.done() for f in futs):
        eng.advance()
    assert [len(f.result().token_ids) for f in futs] == [3, 7, 5, 3]  # sample 3 wraps to l_0
    task = SimTask.from_groups([(2, [3, 7]), (0, [1, 1])])
    assert task.prompt_text(task.rows[0]) == "3,7|" and task.rows[0]["level"] == 2
