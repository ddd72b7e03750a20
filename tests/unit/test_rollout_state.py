"""Streaming / partial controller state that changes what is trained next survives a
checkpoint, and an expired group's prompt is re-queued, not lost (virtual-clock engine)."""

from __future__ import annotations

import pytest

from data.rollout.controller import RolloutContext
from data.rollout.prompts import PromptStream
from data.rollout.selection import Stratified
from data.rollout.staleness import Admit, Drop, Throttle
from data.rollout.streaming import StreamingRollout
from modules.algo.advantages import GroupAdvantage, RunningBaseline
from modules.engine import SamplingConfig
from modules.engine.sim import CharTokenizer, SimEngine, SimTask

SAMPLING = SamplingConfig(max_tokens=1000)

LENGTHS = [4] * 60 + [40] * 20


def bound(ctl, engine, advantage=None):
    task = SimTask(LENGTHS)
    prompts = PromptStream(task.rows, seed=0)
    ctl.bind(RolloutContext(engine, task, CharTokenizer(), prompts, advantage or GroupAdvantage()))
    return ctl


def run(ctl, eng, batches):
    for _ in range(batches):
        ctl.next_batch()
        eng.advance_to(eng.now + 2.0)
        eng.update_weights({}, eng.version + 1, inflight=ctl.inflight)


def streaming(**kw):
    return StreamingRollout(4, 2, SAMPLING, max_inflight=8, max_staleness=2, buffer_capacity=12, **kw)


def test_checkpoint_holds_every_counter_that_steers_training():
    eng = SimEngine(max_concurrency=6)
    a = bound(streaming(selection=Stratified(), reweight=True, staleness=Drop()), eng)
    run(a, eng, 5)
    state = a.state_dict()
    outstanding = a.snapshot()["inflight_groups"] + a.snapshot()["buffer"]
    assert outstanding > 0
    b = bound(streaming(selection=Stratified(), reweight=True, staleness=Drop()), SimEngine())
    b.load_state_dict(state)
    assert b._trained_levels == a._trained_levels and b._trained_levels  # reweighting counts
    assert b.counters == a.counters and b.started_groups == a.started_groups
    assert b.bias.trained_levels == a.bias.trained_levels
    assert b.bias.generated_lengths == a.bias.generated_lengths
    # outstanding groups are re-issued on resume, so their samples leave the issued counts
    assert sum(a.bias.issued_levels.values()) - sum(b.bias.issued_levels.values()) == 2 * outstanding


def test_admission_counters_survive_a_checkpoint():
    eng = SimEngine(max_concurrency=6)
    a = bound(streaming(staleness=Admit()), eng)
    a.batches_per_version = 2
    a.next_batch()  # one of the version's two batches taken
    b = bound(streaming(staleness=Admit()), SimEngine())
    b.load_state_dict(a.state_dict())
    assert (b.bound.taken_at, b.bound.taken_count) == (a.bound.taken_at, a.bound.taken_count) == (0, 1)


@pytest.mark.parametrize("policy", [Admit, Throttle])
def test_a_resume_mid_version_finishes_the_version_without_deadlock(policy):
    # K = 0, two batches per version: a checkpoint after the first batch must resume with one
    # batch left at this version, or admission stays closed (3 batches at one version > 2).
    eng = SimEngine(max_concurrency=6)
    a = bound(StreamingRollout(2, 2, SAMPLING, max_inflight=8, max_staleness=0, staleness=policy()), eng)
    a.batches_per_version = 2
    a.next_batch()
    eng2 = SimEngine(max_concurrency=6)
    b = bound(StreamingRollout(2, 2, SAMPLING, max_inflight=8, max_staleness=0, staleness=policy()), eng2)
    b.batches_per_version = 2
    b.load_state_dict(a.state_dict())
    assert b.batches_taken_this_version() == 1  # the datamodule's sync count starts here
    assert len(b.next_batch()) == 4  # the version's second batch
    eng2.update_weights({}, 1, inflight="keep")  # where the datamodule now syncs
    assert b.batches_taken_this_version() == 0
    assert len(b.next_batch()) == 4 and b.counters["dropped"] == 0


def test_running_baselines_survive_a_checkpoint():
    adv = RunningBaseline("per_prompt")
    ctl = bound(streaming(), SimEngine(), advantage=adv)
    ctl.next_batch()
    fresh = RunningBaseline("per_prompt")
    fresh.load_state_dict(adv.state_dict())
    assert fresh._baselines == adv._baselines and fresh._baselines
    assert fresh.single(1.0, 3) == adv.single(1.0, 3)


def test_an_expired_group_is_requeued_not_lost():
    eng = SimEngine()
    ctl = bound(streaming(max_age_s=50.0), eng)
    ctl.next_batch()
    while not ctl._buffer:  # let a completed group wait in the buffer
        eng.advance()
    old = ctl._buffer[0]
    old.completed_at -= 100.0  # it has waited longer than max_age_s
    row = old.exps[0].extras["row"]
    trained = [e.prompt_id for e in ctl.next_batch()]
    assert ctl.counters["expired"] >= 1
    reissued = [g.row["id"] for g in ctl._groups.values()] + [r.exps[0].prompt_id for r in ctl._buffer]
    reissued += trained
    front = [ctl.ctx.prompts.rows[i]["id"] for i in ctl.ctx.prompts._front]
    assert row["id"] in reissued + front


@pytest.mark.parametrize("taken_before", [0, 1])
def test_the_datamodule_syncs_every_sync_every_batches_also_after_a_resume_mid_version(taken_before):
    from data.rollout.datamodule import RolloutDataModule

    eng = SimEngine(max_concurrency=6)
    ctl = bound(StreamingRollout(2, 2, SAMPLING, max_inflight=8, max_staleness=1, staleness=Throttle()), eng)
    ctl.batches_per_version = 3
    for _ in range(taken_before):  # as a checkpoint saved after this version's first batch
        ctl.next_batch()
    dm = RolloutDataModule(SimTask(LENGTHS), eng, ctl, GroupAdvantage(), sync_every=3)
    stream = dm._rollout_batches()
    due = []
    for _ in range(9 - taken_before):
        _, _, sync = next(stream)
        due.append(sync)
        if sync:  # what the weight-sync callback does after the step
            eng.update_weights({}, eng.version + 1, inflight="keep")
    # the version's remaining batches, then every third: never a sync per batch
    assert due == ([False, False, True] * 3)[taken_before:]


def test_the_datamodule_syncs_by_time_at_batch_boundaries(monkeypatch):
    """data.sync_every_s: a sync is due at the first batch boundary at least T seconds after
    the last sync (wall clock), whatever the batch count (sync_every set past reach)."""
    import data.rollout.datamodule as dm_module
    from data.rollout.datamodule import RolloutDataModule
    from data.rollout.sync import SyncRollout

    clock = [100.0]
    monkeypatch.setattr(dm_module.time, "monotonic", lambda: clock[0])
    eng = SimEngine(max_concurrency=6)
    ctl = bound(SyncRollout(2, 2, SAMPLING), eng)
    dm = RolloutDataModule(SimTask(LENGTHS), eng, ctl, GroupAdvantage(), sync_every=1000, sync_every_s=2.5)
    stream = dm._rollout_batches()
    due = []
    for _ in range(8):
        _, _, sync = next(stream)  # each rollout batch "takes" one second of wall time
        due.append(sync)
        clock[0] += 1.0
        if sync:
            eng.update_weights({}, eng.version + 1, inflight="keep")
    # syncs at t = 103 (3 s after 100) and 106, not per batch and not by count
    assert due == [False, False, False, True, False, False, True, False]
