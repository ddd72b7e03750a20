"""``StalenessBound``: the one object that answers every staleness question, checked by hand.

Start, drop, cancel, weight and admission decisions for each policy, with a bound and without
one (partial rollout's default), and the sizing's ceiling read from the same object.
"""

from __future__ import annotations

import pytest

from data.rollout.experience import Experience
from data.rollout.staleness import (
    Admit,
    Downweight,
    Drop,
    Recompute,
    Regenerate,
    StalenessBound,
    Throttle,
    trainable_groups,
)
from modules.config.errors import ConfigError


def group(n: int = 2) -> list[Experience]:
    return [
        Experience(
            prompt_id=0,
            group_id=0,
            sample_index=i,
            prompt_ids=[1],
            response_ids=[2],
            behavior_logprobs=[-0.5],
            reward=0.0,
            policy_version=0,
            sampling={},
            gen_start=0.0,
            gen_end=0.0,
            truncated=False,
        )
        for i in range(n)
    ]


def test_may_start_counts_batches_left_within_the_bound():
    b = StalenessBound(2, Throttle(), prompts_per_step=4, batches_per_version=1)
    # (K + 1) * 1 batches of 4 groups may be outstanding at version 0
    assert b.may_start(11, version=0) and not b.may_start(12, version=0)
    b.record_take(0)  # one of this version's batches is gone: 2 batches of room left
    assert b.taken(0) == 1 and b.taken(1) == 0
    assert b.may_start(7, version=0) and not b.may_start(8, version=0)
    # a new version restores the full window
    assert b.may_start(11, version=1)
    # two batches per version double it
    b2 = StalenessBound(2, Admit(), prompts_per_step=4, batches_per_version=2)
    assert b2.may_start(23, version=0) and not b2.may_start(24, version=0)


@pytest.mark.parametrize("policy", [Drop(), Downweight(0.5), Recompute()])
def test_policies_that_do_not_throttle_always_start(policy):
    assert StalenessBound(0, policy, prompts_per_step=4).may_start(10**6, version=0)


def test_an_unbounded_bound_never_throttles_drops_or_weights():
    for policy in (Drop(), Throttle(), Downweight(0.5)):
        b = StalenessBound(None, policy, prompts_per_step=4)
        assert b.may_start(10**9, version=0)
        assert not b.too_stale(100, 0) and not b.doomed(100, 0)
        exps = group()
        assert b.admit(exps, version=100, start_version=0) is exps
        assert all(e.weight == 1.0 for e in exps)
        assert b.trainable_groups() is None
    assert trainable_groups(4, 1, None) is None


def test_drop_discards_past_the_bound_and_cancels_one_version_later():
    b = StalenessBound(1, Drop(), prompts_per_step=4)
    assert not b.too_stale(version=3, start_version=2)  # staleness 1 = K: kept
    assert b.too_stale(version=3, start_version=1)  # staleness 2 > K
    assert b.admit(group(), version=3, start_version=1) is None
    # a request starts at or after its submission: doomed only once it is K + 1 versions old
    assert not b.doomed(version=3, start_version=1) and b.doomed(version=3, start_version=0)
    # other policies never drop or cancel
    for policy in (Throttle(), Downweight(0.5), Recompute(), Admit()):
        other = StalenessBound(1, policy, prompts_per_step=4)
        assert not other.too_stale(10, 0) and not other.doomed(10, 0)


def test_weight_and_recompute_past_the_bound_only():
    down = StalenessBound(1, Downweight(gamma=0.5), prompts_per_step=4)
    inside = down.admit(group(), version=2, start_version=1)
    assert [e.weight for e in inside] == [1.0, 1.0]
    past = down.admit(group(), version=4, start_version=1)  # excess 2
    assert [e.weight for e in past] == [0.25, 0.25]
    rec = StalenessBound(0, Recompute(), prompts_per_step=4).admit(group(), version=1, start_version=0)
    assert all(e.recompute for e in rec)
    # throttle trains an over-bound group as it is; admit never sees one (it waits for due groups)
    for policy in (Throttle(), Admit()):
        exps = StalenessBound(1, policy, prompts_per_step=4).admit(group(), version=9, start_version=0)
        assert exps is not None and all(e.weight == 1.0 and not e.recompute for e in exps)


def test_leaves_room_is_admission_controls_due_rule():
    b = StalenessBound(1, Admit(), prompts_per_step=2)
    # at version 0, after this batch: one batch left through version 0 + K = 1, so 2 groups
    # started at version 0 fit and a third does not
    assert b.leaves_room([0, 0], version=0)
    assert not b.leaves_room([0, 0, 0], version=0)
    # groups started at version 1 have until version 2
    assert b.leaves_room([0, 0, 1, 1], version=0)
    assert not b.leaves_room([0, 0, 1, 1, 1], version=0)


def test_state_round_trips_the_batches_taken():
    a = StalenessBound(2, Throttle(), prompts_per_step=4)
    a.record_take(5)
    a.record_take(5)
    b = StalenessBound(2, Throttle(), prompts_per_step=4)
    b.load_state_dict(a.state_dict())
    assert b.taken(5) == 2 and b.taken(6) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_a_bad_bound_names_the_field(bad):
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        StalenessBound(bad, Drop(), prompts_per_step=4)


def test_an_unbounded_admit_never_waits_and_still_counts_versions():
    b = StalenessBound(None, Admit(), prompts_per_step=2)
    assert b.leaves_room([0] * 100, version=0)  # every group is trainable whenever it is taken
    with pytest.raises(ConfigError, match="data.sync_every_s"):  # batches per version still
        b.check_sync_every_s(5.0)  # counted: data.sync_every_s is refused
    assert b.may_start(10**9, version=0)  # but nothing to throttle against


def test_regenerate_throttles_regenerates_past_the_bound_and_never_trains_there():
    b = StalenessBound(1, Regenerate(), prompts_per_step=4)
    assert not b.over_bound(version=9, start_version=0)  # holds the bound: never trained past it
    assert not b.may_start(8, version=0) and b.may_start(7, version=0)  # throttle's issue side
    # past the bound a buffered group is regenerated, a generating one once certainly past it
    assert not b.too_stale(version=3, start_version=2) and b.too_stale(version=3, start_version=1)
    assert not b.doomed(version=3, start_version=1) and b.doomed(version=3, start_version=0)
    assert b.admit(group(), version=2, start_version=1) is not None  # within K: trained
    with pytest.raises(RuntimeError, match="Regenerate"):  # never reaches the batch past K
        b.admit(group(), version=3, start_version=1)
    # unbounded: nothing is past a bound
    assert not StalenessBound(None, Regenerate(), prompts_per_step=4).over_bound(version=100, start_version=0)
    # which policies hold the bound: a group 8 versions past K = 1 is never trained past it
    holds = {
        type(p).__name__: not StalenessBound(1, p, 4).over_bound(version=9, start_version=0)
        for p in (Drop(), Admit(), Throttle(), Downweight(), Recompute())
    }
    assert holds == {"Drop": True, "Admit": True, "Throttle": False, "Downweight": False, "Recompute": False}


def test_due_means_this_batch_is_the_last_chance_within_the_bound():
    b = StalenessBound(2, Regenerate(), prompts_per_step=4, batches_per_version=2)
    # K = 2 at version 5: a group from version 3 is due only if this batch ends the version
    assert not b.due(5, 3)  # 0 of 2 batches taken: another batch comes at version 5
    b.record_take(5)
    assert b.due(5, 3) and not b.due(5, 4)
    assert not StalenessBound(None, Regenerate(), prompts_per_step=4).due(100, 0)


@pytest.mark.parametrize("bad", [-1, 0.5, True, "1"])
def test_a_bad_max_regenerations_names_the_field(bad):
    with pytest.raises(ConfigError, match="rollout.staleness.max_regenerations"):
        Regenerate(bad)


def test_async_grpo_ships_a_bound_that_holds():
    """``rollout.max_staleness`` is a maximum in the shipped async recipe: ``regenerate`` at K = 4
    (a group that can no longer be trained within K is generated again, none is dropped)."""
    from modules.launch.compose import build
    from tests.conftest import compose

    rollout = build(compose(["recipe=async_grpo"]).rollout)
    assert rollout.bound.max_staleness == 4 and isinstance(rollout.bound.policy, Regenerate)
