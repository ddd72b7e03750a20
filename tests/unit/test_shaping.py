"""DAPO's sample shaping (data/rollout/shaping.py): dynamic sampling in every mode, overlong
mask and soft penalty, on the virtual-clock engine with a task whose reward varies within
some groups (responses of 10+ tokens score 1) and not in others."""

from __future__ import annotations

import pytest

from data.rollout.controller import RolloutContext
from data.rollout.experience import collate
from data.rollout.partial import PartialRollout
from data.rollout.prompts import PromptStream
from data.rollout.shaping import InformativeGroups, Overlong
from data.rollout.streaming import StreamingRollout
from data.rollout.sync import SyncRollout
from modules.algo.advantages import GroupAdvantage, RunningBaseline
from modules.config.errors import ConfigError
from modules.engine import SamplingConfig
from modules.engine.sim import CharTokenizer, SimEngine, SimTask

G = 2

INFORMATIVE, FLAT = [4, 12], [4, 4]  # response lengths of a group's two samples


class LengthTask(SimTask):
    def reward(self, row: dict, text: str) -> float:
        return float(len(text) >= 10)


def bind(ctl, groups, advantage=None):
    task = LengthTask.from_groups([(0, ls) for ls in groups])
    ctl.bind(
        RolloutContext(
            SimEngine(), task, CharTokenizer(), PromptStream(task.rows, seed=0), advantage or GroupAdvantage()
        )
    )
    return ctl


def group_rewards(batch):
    out = {}
    for e in batch:
        out.setdefault(e.group_id, []).append(e.reward)
    return list(out.values())


SAMPLING = SamplingConfig(max_tokens=100)


def test_sync_samples_until_the_batch_is_all_informative():
    ctl = bind(SyncRollout(4, G, SAMPLING, group_filter=InformativeGroups()), [INFORMATIVE, FLAT, FLAT] * 40)
    for _ in range(3):
        batch = ctl.next_batch()
        assert len(batch) == 4 * G
        assert all(min(r) != max(r) for r in group_rewards(batch))
    stats = ctl.stats
    assert stats["rollout/filtered"] > 0 and stats["rollout/filter_fill"] == 0
    assert stats["rollout/groups_sampled_per_trained"] > 1


def test_sync_tops_up_with_refused_groups_when_rounds_run_out():
    ctl = bind(SyncRollout(4, G, SAMPLING, group_filter=InformativeGroups(max_rounds=1)), [FLAT] * 200)
    batch = ctl.next_batch()
    assert len(batch) == 4 * G  # the batch keeps its size (DDP shards stay equal)
    assert ctl.stats["rollout/filter_fill"] == 4
    # one extra round of at most 4 P groups (informative rate 0 seen -> 1/4)
    assert ctl.stats["rollout/filtered"] == 4 + 16


def test_without_a_filter_flat_groups_are_trained():
    ctl = bind(SyncRollout(4, G, SAMPLING), [FLAT] * 20)
    assert all(min(r) == max(r) for r in group_rewards(ctl.next_batch()))


@pytest.mark.parametrize("mode", ["streaming", "partial"])
def test_streaming_and_partial_replace_refused_groups(mode):
    f = InformativeGroups()
    if mode == "streaming":
        ctl = StreamingRollout(
            4, G, SAMPLING, max_inflight=8, max_staleness=100, buffer_capacity=16, group_filter=f
        )
    else:
        ctl = PartialRollout(4, G, SAMPLING, over_provision=1.5, group_filter=f)
    bind(ctl, [INFORMATIVE, FLAT, FLAT, FLAT] * 60)
    eng = ctl.ctx.engine
    for v in range(4):
        batch = ctl.next_batch()
        assert len(batch) == 4 * G and all(min(r) != max(r) for r in group_rewards(batch))
        eng.update_weights({}, v + 1, inflight=ctl.inflight)
    assert ctl.snapshot()["filtered"] >= 3 * 16 - 8  # about 3 refused per informative group
    ctl.close()


def test_group_filter_refuses_a_per_response_advantage():
    ctl = StreamingRollout(4, G, SAMPLING, group_filter=InformativeGroups())
    with pytest.raises(ConfigError, match="rollout.group_filter"):
        bind(ctl, [INFORMATIVE] * 10, advantage=RunningBaseline())


def test_overlong_penalty_values():
    o = Overlong(buffer=4, penalty=1.0)
    assert [o.length_penalty(n, 10) for n in (5, 6, 7, 8, 10, 12)] == [0, 0, -0.25, -0.5, -1.0, -1.0]
    assert Overlong().length_penalty(10, 10) == 0
    with pytest.raises(ConfigError, match="rollout.overlong.buffer"):  # refused when bound
        bind(SyncRollout(1, 2, SamplingConfig(max_tokens=8), overlong=Overlong(buffer=8)), [INFORMATIVE])
    with pytest.raises(ConfigError, match="rollout.overlong.filter"):
        Overlong(filter="yes")


def test_overlong_filter_masks_truncated_responses_and_the_penalty_shapes_rewards():
    sampling = SamplingConfig(max_tokens=12)
    ctl = bind(SyncRollout(1, G, sampling, overlong=Overlong(filter=True, buffer=4)), [[4, 30]] * 4)
    batch = ctl.next_batch()
    short, long = sorted(batch, key=lambda e: len(e.response_ids))
    assert long.truncated and len(long.response_ids) == 12 and not short.truncated
    assert long.extras["task_reward"] == 1.0 and long.reward == 0.0  # 1 - 1 (at max_tokens)
    assert short.reward == short.extras["task_reward"] == 0.0
    assert set(long.loss_mask) == {0} and set(short.loss_mask) == {1}
    t = collate(batch, pad_id=0)
    i = batch.index(long)
    assert t["loss_mask"][i].sum() == 0 and t["loss_mask"][1 - i].sum() == 4
    # the group advantage still sees the truncated sample (rewards 0 and 0: flat here)
    assert [e.advantage for e in batch] == [0.0, 0.0]


def test_a_filter_needs_groups_of_two():
    with pytest.raises(ConfigError, match="rollout.group_size"):
        SyncRollout(4, 1, SAMPLING, group_filter=InformativeGroups())


@pytest.mark.parametrize("mode", ["streaming", "partial"])
def test_a_solved_task_cannot_starve_the_trainer(mode):
    """Nothing informative: after the refusal budget (4 x max_rounds x P groups) refused
    groups are trained, counted in filter_fill, and the budget restarts per batch."""
    f = InformativeGroups(max_rounds=1)
    if mode == "streaming":
        ctl = StreamingRollout(
            2, G, SAMPLING, max_inflight=4, max_staleness=100, buffer_capacity=8, group_filter=f
        )
    else:
        ctl = PartialRollout(2, G, SAMPLING, over_provision=1.5, group_filter=f)
    bind(ctl, [FLAT] * 400)
    eng = ctl.ctx.engine
    for v in range(3):
        assert len(ctl.next_batch()) == 2 * G
        eng.update_weights({}, v + 1, inflight=ctl.inflight)
    snap = ctl.snapshot()
    assert snap["filter_fill"] >= 6 and snap["filtered"] >= 8  # every trained group a fill
    ctl.close()


def test_refused_groups_leave_the_issued_counts():
    ctl = bind(SyncRollout(2, G, SAMPLING, group_filter=InformativeGroups()), [INFORMATIVE, FLAT] * 50)
    batch = ctl.next_batch()
    assert sum(ctl.bias.issued_levels.values()) == len(batch)  # only trained samples count


def test_sync_filter_counts_survive_a_checkpoint():
    ctl = bind(SyncRollout(4, G, SAMPLING, group_filter=InformativeGroups()), [INFORMATIVE, FLAT, FLAT] * 40)
    ctl.next_batch()
    state = ctl.state_dict()
    fresh = bind(
        SyncRollout(4, G, SAMPLING, group_filter=InformativeGroups()), [INFORMATIVE, FLAT, FLAT] * 40
    )
    fresh.load_state_dict(state)
    assert fresh.stats["rollout/filtered"] == ctl.stats["rollout/filtered"] > 0


@pytest.mark.parametrize("mode", ["sync", "streaming"])
def test_dynamic_sampling_judges_the_tasks_reward_not_the_length_shaped_one(mode):
    """All answers right but of different lengths: the soft overlong penalty makes the shaped
    rewards differ, yet the group teaches nothing about correctness, so DAPO refuses it (it
    filters on accuracy). Lengths 10 and 12 with max_tokens 12, buffer 4: shaped rewards 0.5
    and 0.0, task rewards 1 and 1."""
    right_both = [10, 12]
    sampling = SamplingConfig(max_tokens=12)
    shaping = {"group_filter": InformativeGroups(max_rounds=1), "overlong": Overlong(buffer=4)}
    if mode == "sync":
        ctl = SyncRollout(1, G, sampling, **shaping)
    else:
        ctl = StreamingRollout(1, G, sampling, max_inflight=2, max_staleness=1, **shaping)
    ctl = bind(ctl, [right_both, [4, 12]] * 20)
    batch = ctl.next_batch()
    assert sorted(e.extras["task_reward"] for e in batch) == [0.0, 1.0]  # only the informative group
    assert ctl.stats["rollout/filtered"] >= 1
