"""Self-sizing streaming (``rollout.max_inflight=auto``) and cancelling doomed groups, on the
simulator: the real controllers on a virtual clock."""

from __future__ import annotations

import math

import pytest

from data.rollout.sizing import Sizing
from modules.config.errors import ConfigError
from modules.engine.sim import SimEngine
from modules.engine.types import SamplingConfig
from modules.launch.compose import build
from tests.conftest import compose


def streaming(*overrides: str):
    cfg = compose(["rollout=streaming", "rollout.prompts_per_step=32", "rollout.group_size=1", *overrides])
    return build(cfg.rollout)


class Ctl:
    def __init__(self, p=16, g=8, k=1, inflight="auto", buffer="auto", per_version=1):
        self.prompts_per_step, self.group_size, self.max_staleness = p, g, k
        self.max_inflight, self.buffer_capacity = inflight, buffer
        self.batches_per_version = per_version


def test_auto_sizing_follows_the_engine_and_the_batch():
    s = Sizing.of(Ctl(p=16, g=8, k=1), concurrency=256)
    assert s.inflight == 32  # 256 requests = 32 groups of 8
    assert Sizing.of(Ctl(p=4, g=4, k=2), concurrency=256).inflight == 12  # P (K + 1) < 64 groups
    assert Sizing.of(Ctl(p=16, g=8, k=8), concurrency=256).inflight == 32  # the engine < 144
    # a version that trains 4 batches lets 4x as many groups be trained within the bound
    assert Sizing.of(Ctl(p=4, g=4, k=2, per_version=4), concurrency=256).inflight == 48
    assert (s.low, s.outstanding, s.high) == (16, 32 + 16, 32 + 16 * 2)
    s = Sizing.of(Ctl(p=16, g=8, k=3), concurrency=None)  # unbounded engine: what K lets train
    assert s.inflight == 64
    fixed = Sizing.of(Ctl(inflight=16, buffer=32), concurrency=256)
    assert (fixed.inflight, fixed.outstanding, fixed.adaptive) == (16, 32, False)
    fixed.observe(5.0)
    fixed.after_take(16, now=1.0)
    fixed.after_take(16, now=2.0)
    assert fixed.outstanding == 32


def test_rate_matching_is_littles_law_within_bounds():
    s = Sizing.of(Ctl(p=16, g=8), concurrency=256)
    start = s.outstanding
    s.after_take(16, now=0.0)
    assert s.outstanding == start  # nothing measured yet: hold
    for lat in [1.0] * 24 + [3.0] * 8:  # mean 1.5 s
        s.observe(lat)
    s.after_take(16, now=2.0)  # 16 groups in 2 s: 8 groups/s
    assert s.rate == pytest.approx(8.0)
    assert s.outstanding == math.ceil(8.0 * 1.5) + 16  # Little: rate x latency generating, + a batch ready
    s.after_take(16, now=6.0)  # a slower trainer (4 groups/s): exponential average 0.7 / 0.3
    assert s.rate == pytest.approx(0.7 * 8 + 0.3 * 4)
    assert s.outstanding == math.ceil(s.rate * 1.5) + 16
    s.after_take(16, now=6.001)  # a burst: the target stops at the capacity
    assert s.outstanding == s.high
    for _ in range(40):
        s.after_take(16, now=1e6 + _ * 1e4)  # a trainer far slower than generation: one batch
    assert s.outstanding == s.low + 1 == 17  # a batch ready and one group generating


@pytest.mark.parametrize("bad", ["many", 0, -3])
def test_bad_sizing_values_name_the_field(bad):
    with pytest.raises(ConfigError, match="rollout.max_inflight"):
        streaming(f"rollout.max_inflight={bad}")
    with pytest.raises(ConfigError, match="rollout.buffer_capacity"):
        streaming(f"rollout.buffer_capacity={bad}")


def test_cancelled_request_frees_its_slot_at_once():
    eng = SimEngine(max_concurrency=1)
    samp = SamplingConfig(max_tokens=1000)
    long = eng.submit([ord(c) for c in "100|"], samp)
    short = eng.submit([ord(c) for c in "10|"], samp)  # queued behind the long one
    eng.advance_to(5)
    assert long.cancel()
    eng.advance()
    assert short.done() and eng.now == 15  # started at 5 when the slot freed, not at 100
    assert eng.slot_time == pytest.approx(5 + 10)  # the cancelled request held its slot 5 units


def test_a_group_is_cancelled_only_once_it_cannot_be_trained():
    from data.rollout.controller import RolloutContext
    from data.rollout.prompts import PromptStream
    from modules.algo.advantages import GroupAdvantage
    from modules.engine.sim import CharTokenizer, SimTask

    ctl = streaming(
        "rollout/staleness=drop",
        "rollout.max_staleness=1",
        "rollout.cancel_doomed=true",
        "rollout.max_inflight=4",
    )
    eng = SimEngine(max_concurrency=64)
    task = SimTask([100] * 50)
    ctl.bind(RolloutContext(eng, task, CharTokenizer(), PromptStream(task.rows, seed=0), GroupAdvantage()))
    with ctl._cv:
        ctl._top_up()  # 4 groups submitted at version 0
        assert len(ctl._groups) == 4
        ctl.bound.policy.retire(
            ctl.bound, ctl, 2
        )  # K + 1 versions after submission: its first token may be newer
        assert len(ctl._groups) == 4 and ctl.counters["cancelled"] == 0
        ctl.bound.policy.retire(
            ctl.bound, ctl, 3
        )  # K + 2: past the bound whenever it started within a version
        assert not ctl._groups and not ctl._requests and ctl.counters["cancelled"] == 4
    assert not eng._running  # every slot freed


def test_auto_passes_start_up_validation_and_bad_values_name_the_field():
    from modules.launch.validate import validate

    validate(compose(["recipe=async_grpo", "rollout.max_inflight=auto", "rollout.buffer_capacity=auto"]))
    with pytest.raises(ConfigError, match="rollout.max_inflight"):
        validate(compose(["recipe=async_grpo", "rollout.max_inflight=2.5"]))


def partial(*overrides: str):
    cfg = compose(["rollout=partial", "rollout.prompts_per_step=32", "rollout.group_size=1", *overrides])
    return build(cfg.rollout)


def test_over_provision_auto_passes_validation_and_bad_values_name_the_field():
    from modules.launch.validate import validate

    validate(compose(["recipe=partial_grpo", "rollout.over_provision=auto"]))
    with pytest.raises(ConfigError, match="rollout.over_provision"):
        validate(compose(["recipe=partial_grpo", "rollout.over_provision=lots"]))
    with pytest.raises(ConfigError, match="rollout.over_provision"):
        partial("rollout.over_provision=0.5")
    with pytest.raises(ConfigError, match="rollout.over_provision"):
        partial("rollout.over_provision=inf")


def test_throttle_never_starts_more_than_k_plus_one_batches_ahead():
    from data.rollout.staleness import Throttle
    from data.rollout.streaming import StreamingRollout
    from tests.unit.test_rollout_modes import SAMPLING, bind

    eng = SimEngine()  # unlimited concurrency: only the throttle holds generation back
    ctl = StreamingRollout(
        4, 2, SAMPLING, max_inflight=100, max_staleness=1, staleness=Throttle(), buffer_capacity=400
    )
    bind(ctl, eng, [5, 50, 5, 5, 200, 5, 7, 9] * 40)
    ctl.next_batch()  # starts generation: at most (K + 1) P groups outstanding at version 0
    assert ctl.started_groups == (1 + 1) * 4  # version 0's batch taken: only version 1's may start
    eng.update_weights({}, 1, inflight="keep")
    trained = []
    for _ in range(12):
        trained += ctl.next_batch()
        snap = ctl.snapshot()
        assert snap["inflight_groups"] + snap["buffer"] <= (1 + 1) * 4  # the bound, issue side
        eng.advance_to(eng.now + 3.0)
        eng.update_weights({}, eng.version + 1, inflight="keep")
    assert ctl.counters["dropped"] == 0
    # the 200-token groups outlive K versions and are trained anyway, counted, not dropped
    assert ctl.counters["over_bound"] > 0
    assert max(e.staleness for e in trained) > 1


def test_rate_matching_counts_dropped_responses_as_groups(monkeypatch):
    """Per-response release (a running baseline): the buffer holds single responses, and a
    dropping policy drops them one by one. What left generation is measured in groups (G
    responses = one group), so the groups counted between takes can never exceed the groups
    started (a run dropped 140 responses while starting 87 groups, and the rate counted 140)."""
    from data.rollout.staleness import Drop
    from data.rollout.streaming import StreamingRollout
    from modules.algo.advantages import RunningBaseline
    from tests.unit.test_rollout_modes import SAMPLING, bind

    counted = []
    real = Sizing.after_take
    monkeypatch.setattr(
        Sizing, "after_take", lambda self, groups, now: (counted.append(groups), real(self, groups, now))[1]
    )
    eng = SimEngine(max_concurrency=64)
    g = 4
    ctl = StreamingRollout(2, g, SAMPLING, max_inflight="auto", max_staleness=0, staleness=Drop())
    bind(ctl, eng, [5, 60, 5, 300, 5, 5, 120, 9] * 40, advantage=RunningBaseline())
    for _ in range(10):
        ctl.next_batch()
        eng.advance_to(eng.now + 20.0)
        eng.update_weights({}, eng.version + 1, inflight="keep")
    assert ctl.counters["dropped"] > g  # responses were dropped
    assert counted and sum(counted) <= ctl.started_groups, (sum(counted), ctl.started_groups)
