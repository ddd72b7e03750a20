"""Self-sizing streaming (``rollout.max_inflight=auto``) and cancelling doomed groups, on the
simulator: the real controllers on a virtual clock."""

from __future__ import annotations

import pytest

from modules.config.errors import ConfigError
from modules.launch.compose import build
from tests.conftest import compose
from tools.pipeline import bounds, simulate

SEED = [(10, 0.9), (100, 0.1)]

LOGNORMAL = [(v, 0.05) for v in (1, 2, 4, 5, 6, 8, 10, 12, 15, 18, 22, 27, 32, 40, 49, 62, 81, 112, 173, 378)]

WORKLOADS = [SEED, LOGNORMAL, [(20, 0.99), (2000, 0.01)]]  # seed, lognormal (sigma 1.5), bimodal


def streaming(*overrides: str):
    cfg = compose(["rollout=streaming", "rollout.prompts_per_step=32", "rollout.group_size=1", *overrides])
    return build(cfg.rollout)


def run(ctl, latencies=SEED, steps=150, step_time=5.0, concurrency=64):
    return simulate(ctl, latencies, steps=steps, step_time=step_time, concurrency=concurrency)


def test_auto_reaches_the_pipeline_bound_where_fixed_defaults_do_not():
    bound = bounds(SEED, 32, 64, 5.0)["pipeline_bound_samples_per_unit"]
    # the old fixed defaults: 16 in flight of 64 slots
    fixed = run(
        streaming("rollout.max_staleness=20", "rollout.max_inflight=16", "rollout.buffer_capacity=32")
    )
    auto = run(
        streaming("rollout.max_staleness=20", "rollout.max_inflight=auto", "rollout.buffer_capacity=auto")
    )
    assert fixed["samples_per_unit"] / bound < 0.3
    assert auto["samples_per_unit"] / bound > 0.95
    assert auto["dropped_groups"] == 0 and auto["staleness_mean"] <= 2.5


def test_trainer_bound_workload_shrinks_what_is_in_flight():
    # training takes 200 units per step, a batch generates in ~20: keep little in flight
    ctl = streaming("rollout/staleness=drop", "rollout.max_staleness=4")
    out = run(ctl, latencies=[(10, 1.0)], steps=40, step_time=200.0)
    assert ctl._sizing.outstanding <= ctl._sizing.low + 2  # about what generates in one step
    # the same ceilings held fixed keep everything full and train 4 versions behind
    full = run(
        streaming(
            "rollout/staleness=drop",
            "rollout.max_inflight=64",
            "rollout.buffer_capacity=224",
            "rollout.max_staleness=4",
        ),
        latencies=[(10, 1.0)],
        steps=40,
        step_time=200.0,
    )
    assert out["staleness_mean"] < 1.5 < 3.0 < full["staleness_mean"]


@pytest.mark.parametrize("k", [1, 2])
def test_cancelling_doomed_groups_wastes_less_engine_time(k):
    common = ("rollout/staleness=drop", f"rollout.max_staleness={k}")
    keep = run(streaming(*common, "rollout.cancel_doomed=false"))
    ctl = streaming(*common, "rollout.cancel_doomed=true")
    cancel = run(ctl)
    assert ctl.counters["cancelled"] > 0 and ctl.counters["cancelled"] <= ctl.counters["dropped"]
    assert cancel["samples_per_unit"] > 1.1 * keep["samples_per_unit"]
    assert cancel["staleness_max"] <= k


def test_moving_the_bound_resizes_what_may_be_outstanding():
    ctl = streaming("rollout.max_inflight=auto", "rollout.buffer_capacity=auto", "rollout.max_staleness=1")
    run(ctl, steps=5)
    before = ctl._sizing.high
    ctl.bound.set_max_staleness(3)
    assert ctl._sizing.high == before + 2 * 32 and ctl.max_staleness == 3


def sync_run(schedule: str, concurrency: int = 8):
    cfg = compose(
        [
            "rollout=sync",
            "rollout.prompts_per_step=32",
            "rollout.group_size=1",
            f"rollout.schedule={schedule}",
        ]
    )
    ctl = build(cfg.rollout)
    return ctl, simulate(ctl, SEED, steps=60, step_time=5.0, concurrency=concurrency)


def test_longest_first_shortens_the_barrier_when_the_batch_exceeds_concurrency():
    _, fifo = sync_run("fifo")
    ctl, lpt = sync_run("longest_first")
    assert lpt["samples_per_unit"] > 1.15 * fifo["samples_per_unit"]
    # the lower bound of an iteration: one long request (100) + the step (5)
    assert lpt["samples_per_unit"] <= 32 / 105 + 1e-9
    # no order beats the makespan bound, E[max(longest, work / slots)] + step; LPT sits on it
    sync_bound = bounds(SEED, 32, 8, 5.0)["sync_samples_per_unit"]
    assert lpt["samples_per_unit"] == pytest.approx(sync_bound, rel=0.03)
    assert fifo["samples_per_unit"] < 0.85 * sync_bound
    # nothing read the answer: the predictor learned lengths per level from what it saw
    assert ctl.lengths.predict({"level": 1}) == pytest.approx(100)
    assert ctl.lengths.predict({"level": 0}) == pytest.approx(10)


def test_schedules_agree_when_everything_starts_at_once():
    _, fifo = sync_run("fifo", concurrency=64)
    _, lpt = sync_run("longest_first", concurrency=64)
    assert lpt["samples_per_unit"] == pytest.approx(fifo["samples_per_unit"])
    with pytest.raises(ConfigError, match="rollout.schedule"):
        build(compose(["rollout=sync", "rollout.schedule=shortest"]).rollout)


def test_planner_recommends_the_fastest_config_within_the_budget():
    from tools.plan import run as plan

    result = plan("seed_workload", [], steps=30, seed=0, budget=1.0, max_level_kl=0.01)
    rows = result["candidates"]
    assert len(rows) >= 10 and {"sync", "partial alpha 2"} <= {r["candidate"] for r in rows}
    best = result["recommended"]
    assert best is not None and best["staleness_mean"] <= 1.0 and best["level_kl"] <= 0.01
    within = [r for r in rows if r["staleness_mean"] <= 1.0 and r["level_kl"] <= 0.01]
    assert best["samples_per_unit"] == max(r["samples_per_unit"] for r in within)
    # a tighter budget can only pick something slower or equal
    tight = plan("seed_workload", [], steps=30, seed=0, budget=0.5, max_level_kl=0.01)["recommended"]
    assert tight is None or tight["samples_per_unit"] <= best["samples_per_unit"]


def partial(*overrides: str):
    cfg = compose(["rollout=partial", "rollout.prompts_per_step=32", "rollout.group_size=1", *overrides])
    return build(cfg.rollout)


def test_auto_over_provisioning_is_the_engine_in_groups_plus_one_batch():
    ctl = partial("rollout.over_provision=auto")
    assert ctl.alpha(64) == pytest.approx(3.0)  # 1 + ceil(64 / 1) / 32
    assert ctl.alpha(None) == pytest.approx(2.0)  # no known concurrency: the old default
    g8 = build(compose(["rollout=partial", "rollout.over_provision=auto"]).rollout)  # P 16, G 8
    assert g8.alpha(256) == pytest.approx(3.0) and g8.alpha(100) == pytest.approx(1 + 13 / 16)
    assert g8.alpha(4096) == pytest.approx(3.0)  # capped: mean staleness about 2 at most
    assert partial("rollout.over_provision=1.5").alpha(64) == pytest.approx(1.5)
    assert partial("rollout.over_provision=1.5").groups_per_iteration(64) == 48
    assert partial("rollout.over_provision=auto", "+rollout.max_staleness=1").alpha(64) == pytest.approx(2.0)
    odd = build(compose(["rollout=partial", "rollout.prompts_per_step=6", "rollout.group_size=1"]).rollout)
    assert odd.groups_per_iteration(7) == 13  # integers: P + 7, no float rounding
    simulate(ctl, SEED, steps=1, step_time=5.0, concurrency=64)
    assert ctl._sizing.inflight == 96  # what one iteration tops the engine up to


@pytest.mark.parametrize("workload", WORKLOADS, ids=["seed", "lognormal", "bimodal"])
def test_auto_partial_reaches_the_bound_unbiased_at_the_littles_law_staleness(workload):
    out = simulate(partial("rollout.over_provision=auto"), workload, steps=150, step_time=5.0, concurrency=64)
    b = bounds(workload, 32, 64, 5.0, max_tokens=384)
    ratio = out["samples_per_unit"] / b["pipeline_bound_samples_per_unit"]
    assert ratio >= 0.9 and out["dropped_groups"] == 0
    assert out.get("bias/level_kl_trained_vs_issued", 0.0) < 1e-3  # the issued mix is trained
    # Little's law: staleness cannot be much below X E[L] / batch; auto sits at it (~2 here)
    floor = ratio * b["staleness_floor_at_bound"]
    assert 0.9 * floor <= out["staleness_mean"] <= 2.05
    two = simulate(partial("rollout.over_provision=2"), workload, steps=150, step_time=5.0, concurrency=64)
    assert two["samples_per_unit"] < 0.7 * out["samples_per_unit"]  # the old fixed default


def test_moving_the_bound_resizes_auto_over_provisioning():
    ctl = partial("rollout.over_provision=auto")
    simulate(ctl, SEED, steps=2, step_time=5.0, concurrency=64)
    assert ctl._sizing.inflight == 96  # P + 64 groups
    ctl.bound.set_max_staleness(1)  # what the drift controller does
    assert ctl.max_staleness == 1 and ctl._sizing.inflight == 64 and ctl.alpha(64) == pytest.approx(2.0)


def test_the_floor_and_the_cap_count_batches_per_version():
    b = bounds(SEED, 8, 64, 1.0, sync_every=4)  # generation-bound: min(64 / 19, 8 / 1)
    assert b["staleness_floor_at_bound"] == pytest.approx(64 / (8 * 4))
    ctl = streaming("rollout.prompts_per_step=8", "rollout.max_inflight=auto", "rollout.buffer_capacity=auto")
    out = simulate(ctl, SEED, steps=80, step_time=1.0, concurrency=64, sync_every=4)
    assert ctl._sizing.inflight == 64  # min(64, 8 x 4 x 2): the engine, not one batch's worth
    assert out["engine_utilisation"] > 0.9


@pytest.mark.parametrize("workload", WORKLOADS, ids=["seed", "lognormal", "bimodal"])
def test_shipped_streaming_reaches_the_bound_unbiased_where_drop_and_admit_do_not(workload):
    # the shipped config as is (auto sizing, throttle, K = 2): only the workload changes
    b = bounds(workload, 32, 64, 5.0, max_tokens=384)
    bound = b["pipeline_bound_samples_per_unit"]
    out = simulate(streaming(), workload, steps=150, step_time=5.0, concurrency=64)
    ratio = out["samples_per_unit"] / bound
    assert ratio >= 0.9 and out["dropped_groups"] == 0
    assert out.get("bias/level_kl_trained_vs_issued", 0.0) < 1e-3  # the issued mix is trained
    assert 0.9 * ratio * b["staleness_floor_at_bound"] <= out["staleness_mean"] <= 2.05
    admit = simulate(streaming("rollout/staleness=admit"), workload, steps=150, step_time=5.0, concurrency=64)
    assert admit["samples_per_unit"] < 0.5 * out["samples_per_unit"]  # the trainer waits for due groups
    drop = simulate(streaming("rollout/staleness=drop"), workload, steps=150, step_time=5.0, concurrency=64)
    assert drop["dropped_groups"] > 0  # reaching K = 2 by dropping what outlives it
    old = streaming("rollout/staleness=drop", "rollout.max_inflight=16", "rollout.buffer_capacity=32")
    before = simulate(old, workload, steps=150, step_time=5.0, concurrency=64)  # the old defaults
    assert before["samples_per_unit"] < 0.15 * bound


def test_the_planner_weighs_a_bound_that_holds_beside_a_target():
    """``regenerate`` is a planner candidate at every K: on the seeds' workload (long groups
    outlive K = 2) it trains nothing past K, where ``throttle`` at the same K does."""
    from tools.plan import run

    rows = {r["candidate"]: r for r in run("seed_workload", [], 60, 0, 2.0, 0.01)["candidates"]}
    for k in (1, 2, 4, 8):
        assert rows[f"streaming K={k} regenerate"]["staleness_max"] <= k
    assert rows["streaming K=2 throttle"]["staleness_max"] > 2


def test_partial_rollout_under_a_bound_regenerates_by_default_and_drops_when_asked():
    """conf/rollout/partial.yaml: past a bound K a group is generated again, not dropped (the
    uncapped agent sitting, lab/README.md); ``rollout/staleness=drop`` is one override away."""
    from data.rollout.staleness import Drop, Regenerate

    tail = [(10, 0.7), (400, 0.3)]  # a heavy tail: long groups outlive K = 1
    runs = {}
    for name, extra in (("default", []), ("drop", ["rollout/staleness=drop"])):
        ctl = partial("rollout.over_provision=3.0", "+rollout.max_staleness=1", *extra)
        assert isinstance(ctl.bound.policy, Regenerate if name == "default" else Drop)
        runs[name] = (ctl, simulate(ctl, tail, steps=12, step_time=5.0, concurrency=64))
    (ctl, fig), (_, dropped) = runs["default"], runs["drop"]
    assert dropped["dropped_groups"] > 0  # the same workload drops under drop
    assert fig["dropped_groups"] == 0 and ctl.counters["regenerated"] > 0
    assert fig["staleness_max"] <= 1  # and K holds
    assert isinstance(build(compose(["recipe=partial_grpo"]).rollout).bound.policy, Regenerate)  # unbounded
