"""Rollout-mode semantics on the simulated virtual-clock engine (modules/engine/sim.py).

The fake engine is a fixture for exact timing; the same controllers drive vLLM in training.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.rollout.controller import RewardError, RolloutContext
from data.rollout.partial import PartialRollout
from data.rollout.prompts import PromptStream
from data.rollout.selection import Fifo, Stratified
from data.rollout.staleness import Admit, Downweight, Drop, Recompute, Regenerate, Throttle
from data.rollout.streaming import StreamingRollout
from data.rollout.sync import SyncRollout
from modules.algo.advantages import GroupAdvantage, RunningBaseline
from modules.engine import EngineError, SamplingConfig
from modules.engine.sim import CharTokenizer, SimEngine, SimTask


def bind(ctl, engine, lengths, fail=False, advantage=None):
    task = SimTask(lengths, fail=fail)
    advantage = advantage or GroupAdvantage()
    ctl.bind(RolloutContext(engine, task, CharTokenizer(), PromptStream(task.rows, seed=0), advantage))
    return ctl


SEED_WORKLOAD = [10] * 90 + [100] * 10  # the seeds' example: 90 short, 10 long

SAMPLING = SamplingConfig(max_tokens=1000)


def test_seed_example_streaming_updates_when_32nd_short_request_finishes():
    eng = SimEngine()
    ctl = bind(
        StreamingRollout(32, 1, SAMPLING, max_inflight=100, max_staleness=10, buffer_capacity=100),
        eng,
        SEED_WORKLOAD,
    )
    batch = ctl.next_batch()
    assert eng.now == 10 and len(batch) == 32
    assert all(len(e.response_ids) == 10 for e in batch)


def test_seed_example_sync_waits_for_the_last_long_request():
    eng = SimEngine()
    ctl = bind(SyncRollout(100, 1, SAMPLING), eng, SEED_WORKLOAD)
    batch = ctl.next_batch()
    assert eng.now == 100 and len(batch) == 100


def test_seed_example_partial_ends_at_the_pth_complete_group_and_carries_the_rest():
    eng = SimEngine()
    ctl = bind(PartialRollout(16, 1, SAMPLING, over_provision=2.0), eng, SEED_WORKLOAD)
    batch = ctl.next_batch()
    snap = ctl.snapshot()
    assert eng.now == 10 and len(batch) == 16
    assert snap["started_groups"] == 32  # ceil(alpha * P) issued
    # the 32 issued minus 16 trained are carried over: finished extras wait in the buffer,
    # long ones keep generating; the next iteration tops up to 32 again
    assert snap["buffer"] + snap["inflight_groups"] == 16
    eng.update_weights({}, 1, inflight="keep")
    ctl.next_batch()
    assert ctl.snapshot()["started_groups"] == 32 + 16


def run(ctl, eng, batches, step_time=1.0, sync_every=1):
    trained = []
    ctl.batches_per_version = sync_every
    for b in range(batches):
        batch = ctl.next_batch()
        trained.append((eng.version, batch))
        assert ctl.snapshot()["buffer"] <= ctl.buffer_capacity
        eng.advance_to(eng.now + step_time)  # the training step takes virtual time
        if (b + 1) % sync_every == 0:
            eng.update_weights({}, eng.version + 1, inflight=ctl.inflight)
    return trained


@pytest.mark.parametrize("policy", [Admit(), Drop()])
def test_max_staleness_zero_is_sync_semantics(policy):
    lengths = [3, 7, 40, 12, 90, 5, 5, 60, 2, 33] * 5
    eng = SimEngine()
    ctl = bind(
        StreamingRollout(
            4, 2, SAMPLING, max_inflight=8, max_staleness=0, staleness=policy, buffer_capacity=16
        ),
        eng,
        lengths,
    )
    for version, batch in run(ctl, eng, 6):
        assert len(batch) == 8
        for e in batch:
            assert set(e.token_versions()) == {version}  # every trained token from the current policy
            assert e.staleness == 0
    if isinstance(policy, Admit):
        assert ctl.snapshot()["dropped"] == 0


def test_abort_carry_over_keeps_logprobs_versions_and_mask_aligned():
    eng = SimEngine()
    ctl = bind(
        StreamingRollout(
            1, 1, SAMPLING, max_inflight=2, max_staleness=5, inflight="abort", buffer_capacity=4
        ),
        eng,
        [4, 30],
    )
    first = ctl.next_batch()  # the 4-token request; the 30-token one is 4 tokens in
    assert len(first[0].response_ids) == 4
    eng.update_weights({}, 1, inflight="abort")  # abort -> resubmit prompt + 4 partial tokens
    out = []
    while not any(len(e.response_ids) == 30 for e in out):
        out += ctl.next_batch()
        eng.update_weights({}, eng.version + 1, inflight="abort")
    e = next(e for e in out if len(e.response_ids) == 30)
    assert e.splits == 1 and len(e.behavior_logprobs) == 30 and sum(e.loss_mask) == 30
    assert e.version_spans == [(0, 0, 4), (1, 4, 30)]
    assert e.token_versions()[:4] == [0] * 4 and e.token_versions()[4:] == [1] * 26
    assert ctl.snapshot()["carried_over"] >= 1


def test_keep_in_flight_update_records_version_spans():
    eng = SimEngine()
    ctl = bind(
        StreamingRollout(1, 1, SAMPLING, max_inflight=2, max_staleness=5, inflight="keep", buffer_capacity=4),
        eng,
        [4, 30],
    )
    ctl.next_batch()
    eng.update_weights({}, 1, inflight="keep")
    e = next(e for e in ctl.next_batch() if len(e.response_ids) == 30)
    assert e.splits == 0 and e.version_spans == [(0, 0, 4), (1, 4, 30)]
    assert e.policy_version == 0  # started under version 0: staleness counts from the oldest token


def test_downweight_and_recompute_mark_stale_groups():
    for policy, check in [
        (Downweight(gamma=0.5), lambda e: e.weight == 0.5 ** (e.staleness - 0)),
        (Recompute(), lambda e: e.recompute),
    ]:
        eng = SimEngine()
        ctl = bind(
            StreamingRollout(
                2, 1, SAMPLING, max_inflight=6, max_staleness=0, staleness=policy, buffer_capacity=8
            ),
            eng,
            [1, 1, 1, 1, 1, 1, 50, 50],
        )
        stale = [e for _, b in run(ctl, eng, 4) for e in b if e.staleness > 0]
        assert stale and all(check(e) for e in stale)


def test_reward_failure_surfaces_in_the_trainer():
    eng = SimEngine()
    ctl = bind(StreamingRollout(2, 2, SAMPLING, max_inflight=4), eng, [3, 5, 8], fail=True)
    with pytest.raises(RewardError, match="verifier crashed"):
        ctl.next_batch()


def test_engine_death_surfaces_in_the_trainer():
    eng = SimEngine()
    ctl = bind(StreamingRollout(2, 2, SAMPLING, max_inflight=4), eng, [30, 50])
    eng.kill()
    with pytest.raises(EngineError):
        ctl.next_batch()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 120), min_size=3, max_size=40),
    group_size=st.integers(1, 3),
    prompts_per_step=st.integers(1, 4),
    max_inflight=st.integers(1, 8),
    max_staleness=st.integers(0, 3),
    policy=st.sampled_from(["drop", "admit", "downweight", "throttle", "regenerate"]),
    inflight=st.sampled_from(["keep", "abort", "wait"]),
    concurrency=st.one_of(st.none(), st.integers(1, 6)),
    sync_every=st.integers(1, 3),
)
def test_streaming_invariants(
    lengths,
    group_size,
    prompts_per_step,
    max_inflight,
    max_staleness,
    policy,
    inflight,
    concurrency,
    sync_every,
):
    staleness = {
        "drop": Drop(),
        "admit": Admit(),
        "downweight": Downweight(0.5),
        "throttle": Throttle(),
        "regenerate": Regenerate(),
    }[policy]
    eng = SimEngine(max_concurrency=concurrency)
    capacity = max(prompts_per_step, max_inflight) + 2
    ctl = bind(
        StreamingRollout(
            prompts_per_step,
            group_size,
            SAMPLING,
            max_inflight=max_inflight,
            max_staleness=max_staleness,
            staleness=staleness,
            buffer_capacity=capacity,
            inflight=inflight,
        ),
        eng,
        lengths,
    )
    seen = set()
    for version, batch in run(ctl, eng, 6, step_time=7.0, sync_every=sync_every):
        groups = {}
        for e in batch:
            key = (e.group_id, e.sample_index)
            assert key not in seen, "a response was trained twice"
            seen.add(key)
            groups.setdefault(e.group_id, []).append(e)
            assert len(e.behavior_logprobs) == len(e.response_ids) == len(e.token_versions())
            assert e.staleness == version - min(e.token_versions())
            if policy in ("drop", "admit", "regenerate"):
                assert e.staleness <= max_staleness
        assert all(len(g) == group_size for g in groups.values()), "an incomplete group was trained"
        assert len(groups) == prompts_per_step
    if policy in ("admit", "throttle", "regenerate"):
        assert ctl.snapshot()["dropped"] == 0


def long_tail_streaming(**kwargs):
    """80 short (level 0) and 20 long (level 1) prompts, K=2 with drop, 8 generating at once."""
    eng = SimEngine(max_concurrency=8)
    ctl = StreamingRollout(
        8, 1, SAMPLING, max_inflight=16, max_staleness=2, staleness=Drop(), buffer_capacity=24, **kwargs
    )
    return bind(ctl, eng, [4] * 80 + [60] * 20), eng


def bias_run(stratify: bool) -> dict[str, float]:
    ctl, eng = long_tail_streaming(selection=Stratified() if stratify else Fifo())
    run(ctl, eng, 12, step_time=3.0)  # each batch handed out is counted as trained (HandOff.hand_out)
    return ctl.bias.metrics()


def test_completion_time_bias_is_measured_and_stratified_batches_reduce_it():
    plain, strat = bias_run(False), bias_run(True)
    # first-finished consumption under-trains the long level and biases lengths
    assert plain["bias/level_kl_trained_vs_issued"] > 0.01
    assert plain["bias/len_kl_trained_vs_issued"] > 0
    assert strat["bias/level_kl_trained_vs_issued"] < plain["bias/level_kl_trained_vs_issued"] / 2
    assert strat.get("bias/trained_frac_level1", 0) > plain.get("bias/trained_frac_level1", 0)


def test_sync_mode_has_no_length_bias():
    eng = SimEngine()
    ctl = bind(SyncRollout(4, 2, SAMPLING), eng, [4, 60, 9, 30])
    for _ in range(3):
        ctl.next_batch()  # counted as trained when handed out
    m = ctl.bias.metrics()
    assert m["bias/len_kl_trained_vs_issued"] < 1e-9 and m["bias/level_kl_trained_vs_issued"] < 1e-9


def test_reweighting_moves_the_trained_level_mix_towards_the_issued_mix():
    ctl, eng = long_tail_streaming(reweight=True)
    trained = [e for _, batch in run(ctl, eng, 12, step_time=3.0) for e in batch]
    issued = ctl.bias.issued_levels[1] / sum(ctl.bias.issued_levels.values())
    plain = sum(e.difficulty == 1 for e in trained) / len(trained)
    weighted = sum(e.weight for e in trained if e.difficulty == 1) / sum(e.weight for e in trained)
    assert plain < issued  # long prompts are under-trained when the first finished are consumed
    assert abs(weighted - issued) < abs(plain - issued)


def test_reward_errors_can_score_zero_and_be_counted():
    eng = SimEngine()
    ctl = bind(StreamingRollout(2, 2, SAMPLING, max_inflight=4), eng, [3, 5, 8], fail=True)
    ctl.configure_rewards("zero")
    batch = ctl.next_batch()
    assert all(e.reward == 0.0 for e in batch) and ctl.reward_error_count >= 4


def test_streaming_checkpoint_requeues_outstanding_prompts():
    eng = SimEngine()
    ctl = bind(
        StreamingRollout(2, 1, SAMPLING, max_inflight=4, max_staleness=5, buffer_capacity=8),
        eng,
        [3, 50, 4, 60, 5, 70, 6, 80],
    )
    trained = ctl.next_batch()
    outstanding = ctl.outstanding_prompts()
    assert outstanding and not {e.prompt_id for e in trained} & set(outstanding)
    state = ctl.ctx.prompts.state_dict()
    fresh = PromptStream(ctl.ctx.prompts.rows, seed=0)
    fresh.load_state_dict({**state, "front": outstanding + state["front"]})
    assert [fresh.next()["id"] for _ in outstanding] == outstanding  # served first on resume


@pytest.mark.parametrize("scope", ["global", "per_prompt"])
def test_running_baseline_lets_single_responses_flow_before_their_group(scope):
    def first_batch_time(advantage):
        eng = SimEngine(jitter=60)  # responses of one prompt take 10..70 units
        ctl = bind(
            StreamingRollout(1, 4, SAMPLING, max_inflight=2, max_staleness=5, buffer_capacity=4),
            eng,
            [10, 10, 10, 10],
            advantage=advantage,
        )
        batch = ctl.next_batch()
        return eng.now, batch

    t_group, group_batch = first_batch_time(GroupAdvantage())
    t_single, single_batch = first_batch_time(RunningBaseline(scope))
    assert len(group_batch) == len(single_batch) == 4
    assert len({e.group_id for e in group_batch}) == 1  # GRPO: one complete group
    assert t_single < t_group  # the running baseline does not wait for a group's slowest response
    assert all(math.isfinite(e.advantage) for e in single_batch)


def test_running_baseline_is_rejected_with_admission_control():
    from modules.config.errors import ConfigError

    with pytest.raises(ConfigError, match="algo.advantage"):
        bind(
            StreamingRollout(1, 4, SAMPLING, staleness=Admit()),
            SimEngine(),
            [10],
            advantage=RunningBaseline(),
        )


def bound_run(staleness, batches=40, **kwargs):
    """The long tail against a bound: 80 short (4 units) and 20 long (60) prompts, G = 2,
    K = 1, P = 4: a long group outlives two versions."""
    eng = SimEngine(max_concurrency=8)
    ctl = bind(
        StreamingRollout(
            4, 2, SAMPLING, max_inflight=8, max_staleness=1, staleness=staleness, buffer_capacity=16, **kwargs
        ),
        eng,
        [4] * 80 + [60] * 20,
    )
    return ctl, run(ctl, eng, batches, step_time=3.0)


def test_throttle_treats_the_bound_as_a_target_and_regenerate_holds_it():
    ctl, trained = bound_run(Throttle())
    over = max(e.staleness for _, batch in trained for e in batch)
    assert over > 1 and ctl.snapshot()["over_bound"] > 0  # a long group trained past K = 1
    ctl, trained = bound_run(Regenerate())
    snap = ctl.snapshot()
    exps = [e for _, batch in trained for e in batch]
    assert max(e.staleness for e in exps) <= 1  # the bound holds
    assert snap["regenerated"] > 0 and snap["dropped"] == 0 and snap["over_bound"] == 0
    long_trained = {e.prompt_id for e in exps if e.difficulty == 1}
    assert long_trained  # a prompt too long for the bound is still trained (waited for)
    # nothing lost: every regenerated prompt was trained, or is still outstanding
    trained_ids = {e.prompt_id for e in exps}
    outstanding = set(ctl.outstanding_prompts()) | set(ctl.ctx.prompts.state_dict()["front"])
    rows = ctl.ctx.prompts.rows
    assert {rows[i]["id"] for i in ctl._regenerations} <= outstanding | trained_ids
    for e in exps:  # regeneration counts end when a prompt is trained
        assert (
            ctl.ctx.prompts.index_of(rows[e.prompt_id]) not in ctl._regenerations
            or e.prompt_id in outstanding
        )


def test_regenerate_without_waiting_regenerates_a_too_long_prompt_again():
    protected, _ = bound_run(Regenerate(max_regenerations=1))
    eager, trained = bound_run(Regenerate(max_regenerations=5))
    assert max(e.staleness for _, batch in trained for e in batch) <= 1
    # waiting after one regeneration spends less generation than regenerating up to 5 times
    assert protected.snapshot()["regenerated"] < eager.snapshot()["regenerated"]


def test_regenerate_refuses_a_running_baseline():
    from modules.config.errors import ConfigError

    with pytest.raises(ConfigError, match="regenerate"):
        bind(
            StreamingRollout(1, 4, SAMPLING, staleness=Regenerate()),
            SimEngine(),
            [10],
            advantage=RunningBaseline(),
        )


def test_regenerate_refuses_a_running_baseline_even_while_unbounded():
    """An unbounded K is finite later (the drift controller lowers it): refused at bind anyway."""
    from modules.config.errors import ConfigError

    with pytest.raises(ConfigError, match="regenerate"):
        bind(
            StreamingRollout(
                1, 4, SAMPLING, max_staleness=None, max_inflight=4, buffer_capacity=4, staleness=Regenerate()
            ),
            SimEngine(),
            [10],
            advantage=RunningBaseline(),
        )


def test_partial_rollout_runs_its_staleness_policys_own_start_up_check():
    """Partial rollout refuses what its base refuses and, beyond that, whatever its staleness
    policy refuses (a policy stricter than every built-in one)."""

    from modules.config.errors import ConfigError

    class RefusesEverything(Throttle):
        def check_advantage(self, advantage: object) -> None:
            raise ConfigError("algo.advantage: refused by the policy")

    with pytest.raises(ConfigError, match="refused by the policy"):
        bind(
            PartialRollout(1, 4, SAMPLING, max_staleness=2, staleness=RefusesEverything()),
            SimEngine(),
            [10],
            advantage=GroupAdvantage(),
        )


def test_partial_rollout_refills_a_regenerated_group_when_the_bound_is_lowered():
    """K lowered at run time (drift controller): partial's carried-over group is past it and is
    regenerated mid-iteration; the iteration still gets its P groups (no wait on nothing)."""
    eng = SimEngine()
    ctl = bind(
        PartialRollout(1, 1, SAMPLING, over_provision=2.0, max_staleness=1, staleness=Regenerate()),
        eng,
        [5] * 20,
    )
    ctl.next_batch()  # 2 groups started, 1 trained, 1 carried over
    eng.advance_to(eng.now + 1.0)
    eng.update_weights({}, 1, inflight="keep")
    ctl.bound.set_max_staleness(0)
    batch = ctl.next_batch()
    assert [e.staleness for e in batch] == [0] and ctl.snapshot()["regenerated"] == 1


def test_a_protected_prompt_takes_the_batch_before_an_unprotected_due_one():
    """P = 1, K = 2. Prompt 1 was regenerated once (protected), prompt 2 not; both start at
    version 0 and are due at version 2. Prompt 2 completes first, but prompt 1 is waited for
    and trained; prompt 2 is the one regenerated."""
    eng = SimEngine()
    task = SimTask([1, 25, 20] + [1] * 50)
    stream = PromptStream(task.rows, seed=0)
    stream.requeue([0, 1, 2, 3])
    ctl = StreamingRollout(
        1, 1, SAMPLING, max_inflight=3, max_staleness=2, staleness=Regenerate(1), buffer_capacity=3
    )
    ctl.bind(RolloutContext(eng, task, CharTokenizer(), stream, GroupAdvantage()))
    ctl._regenerations[1] = 1  # as if regenerated once before
    trained = []
    for _ in range(4):
        batch = ctl.next_batch()
        assert all(e.staleness <= 2 for e in batch)
        trained.append([e.prompt_id for e in batch])
        if trained[-1] == [1]:  # a checkpoint that gives this batch back keeps its count
            assert [1, 1] in ctl.state_dict(in_training=True)["regenerations"]
            assert [1, 1] not in ctl.state_dict()["regenerations"]
        eng.advance_to(eng.now + 10.0)
        eng.update_weights({}, eng.version + 1, inflight="keep")
    assert trained[:3] == [[0], [3], [1]] and 2 not in trained[3]
    assert ctl.counters["regenerated"] == 1 and 1 not in ctl._regenerations  # trained: count done
