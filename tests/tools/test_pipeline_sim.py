"""The pipeline simulator: real controllers on a virtual clock, checked against analytical values."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate

from data.rollout.streaming import StreamingRollout
from data.rollout.sync import SyncRollout
from tests.conftest import compose
from tools.pipeline import bounds, expected_max, simulate


def controller(mode: str, *overrides: str):
    cfg = compose([f"rollout={mode}", "rollout.prompts_per_step=32", "rollout.group_size=1", *overrides])
    return instantiate(cfg.rollout)


def test_expected_max_of_the_seed_mixture():
    assert expected_max([(10, 1.0)], 32) == pytest.approx(10)
    assert expected_max([(10, 0.9), (100, 0.1)], 32) == pytest.approx(100 - 90 * 0.9**32)


def test_deterministic_sync_matches_the_analytical_throughput():
    ctl = controller("sync")
    assert isinstance(ctl, SyncRollout)
    out = simulate(ctl, [(10, 1.0)], steps=100, step_time=5.0, concurrency=64)
    assert out["samples_per_unit"] == pytest.approx(32 / 15, rel=0.02)
    assert out["samples_per_unit"] == pytest.approx(
        bounds([(10, 1.0)], 32, 64, 5.0)["sync_samples_per_unit"], rel=0.02
    )


def test_deterministic_streaming_matches_the_pipeline_bound():
    ctl = controller(
        "streaming", "rollout.max_inflight=64", "rollout.buffer_capacity=128", "rollout.max_staleness=10"
    )
    assert isinstance(ctl, StreamingRollout)
    out = simulate(ctl, [(10, 1.0)], steps=200, step_time=5.0, concurrency=64)
    bound = bounds([(10, 1.0)], 32, 64, 5.0)["pipeline_bound_samples_per_unit"]  # min(64/10, 32/5) = 6.4
    assert out["samples_per_unit"] == pytest.approx(bound, rel=0.02)


def test_streaming_reaches_95_percent_of_the_bound_on_the_seed_workload():
    lat = [(10, 0.9), (100, 0.1)]
    ctl = controller(
        "streaming", "rollout.max_inflight=64", "rollout.buffer_capacity=96", "rollout.max_staleness=20"
    )
    out = simulate(ctl, lat, steps=300, step_time=5.0, concurrency=64)
    b = bounds(lat, 32, 64, 5.0)
    assert out["samples_per_unit"] >= 0.95 * b["pipeline_bound_samples_per_unit"]
    sync = simulate(controller("sync"), lat, steps=60, step_time=5.0, concurrency=64)
    assert sync["samples_per_unit"] == pytest.approx(b["sync_samples_per_unit"], rel=0.1)
    assert out["samples_per_unit"] > 5 * sync["samples_per_unit"]


def test_bounds_clip_latencies_at_max_tokens():
    # half the responses would run 1000 units but stop at max_tokens=100
    lat = [(10, 0.5), (1000, 0.5)]
    clipped = bounds(lat, 32, 64, 5.0, max_tokens=100)
    assert clipped == bounds([(10, 0.5), (100, 0.5)], 32, 64, 5.0)
    ctl = controller("sync", "rollout.sampling.max_tokens=100")
    out = simulate(ctl, lat, steps=50, step_time=5.0, concurrency=64)
    # sync cannot beat its bound once the bound knows about the cap
    assert out["samples_per_unit"] <= clipped["sync_samples_per_unit"] * 1.02
    assert out["samples_per_unit"] > 1.5 * bounds(lat, 32, 64, 5.0)["sync_samples_per_unit"]


def test_sync_makespan_is_the_longest_response_or_the_work_per_slot():
    from tools.pipeline import sync_makespan

    assert sync_makespan([(10, 1.0)], 32, 8) == pytest.approx(40)  # 320 units of work on 8 slots
    assert sync_makespan([(10, 1.0)], 32, 64) == pytest.approx(10)  # everything at once
    # G equal-length responses per prompt: 4 prompts of 8, not 32 independent draws
    lat = [(10, 0.9), (100, 0.1)]
    assert sync_makespan(lat, 32, 64, group_size=8) == pytest.approx(expected_max(lat, 4))
    assert sync_makespan([(10, 1.0)], 32, 8, group_size=8) == pytest.approx(40)


def test_the_sync_bound_holds_with_groups():
    lat = [(10, 0.9), (100, 0.1)]
    ctl = controller("sync", "rollout.prompts_per_step=4", "rollout.group_size=8")  # 4 prompts x 8
    out = simulate(ctl, lat, steps=200, step_time=5.0, concurrency=64)
    bound = bounds(lat, 32, 64, 5.0, group_size=8)["sync_samples_per_unit"]
    assert out["samples_per_unit"] == pytest.approx(bound, rel=0.1)


def test_a_dropping_config_is_also_measured_against_the_mix_it_trains():
    from tools.pipeline import ratios

    lat = [(10, 0.9), (100, 0.1)]
    ctl = controller("streaming", "rollout/staleness=drop", "rollout.max_staleness=2")
    out = simulate(ctl, lat, steps=100, step_time=5.0, concurrency=64)
    r = ratios(out, lat, 32, 64, 5.0, 384)
    # it drops the long groups: its trained mix is shorter, so its own bound is higher
    assert out["dropped_groups"] > 0 and sum(out["trained_lengths"].values()) == pytest.approx(1.0)
    assert r["trained_mix_bounds"]["mean_latency"] < r["bounds"]["mean_latency"]
    assert r["ratio_to_trained_mix_bound"] < r["ratio_to_pipeline_bound"]
    assert r["bounds"]["staleness_floor_at_bound"] == pytest.approx(64 / 32)  # concurrency / batch
