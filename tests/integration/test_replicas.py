"""Rollout replicas (``engine.replicas=R``): dispatch, one version across replicas, failure,
core/GPU splits, and tensor-parallel checks. Fast tests use in-process fake replicas; the
``engine`` tests run two real vLLM-CPU engines, one per core."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from modules.engine import EngineError, SamplingConfig
from modules.engine.replicas import build_engine


@pytest.fixture(scope="module")
def two_replicas(models):
    from tests.integration.test_engine import engine_processes

    eng = build_engine(
        model_path=str(models["untied"]),
        replicas=2,
        cpu_cores="0-1",
        pin_trainer=False,
        max_model_len=256,
        max_num_seqs=16,
        executor="uni",  # one process per replica, ~10 s less start-up each
    )
    pids = []
    for r in eng.replicas:  # one at a time, to know each replica's processes
        before = {p.pid for p in engine_processes()}
        r.start()
        pids.append({p.pid for p in engine_processes(exclude=before)})
    eng.start()
    eng.replica_pids = pids
    yield eng
    eng.shutdown()


@pytest.mark.engine
def test_two_real_replicas_share_work_and_one_version(two_replicas, models):
    from modules.policy.hf_policy import load_policy, named_weights
    from tests.integration.test_engine import _perturb, trainer_logprobs

    eng = two_replicas
    model, tok = load_policy(models["untied"])
    model.eval()
    sampling = SamplingConfig(max_tokens=24)
    prompts = [tok(f"{a}%7=")["input_ids"] for a in (31, 47, 58, 62)]
    futs = [eng.submit(p, sampling, seed=10 * i + j) for i, p in enumerate(prompts) for j in range(3)]
    outs = [eng.wait_result(f, timeout=120) for f in futs]
    stats = eng.stats()
    assert stats["perf/engine0/requests"] == stats["perf/engine1/requests"] == 6  # both used
    _perturb(model, 0.05, seed=1)
    eng.update_weights(named_weights(model), 1)
    assert [r.version for r in eng.replicas] == [1, 1] and eng.version == 1
    futs = [eng.submit(p, sampling, seed=7) for p in prompts]  # spread over both replicas
    for f, p in zip(futs, prompts):
        c = eng.wait_result(f, timeout=120)
        assert c.version_spans == [(1, 0, len(c.token_ids))]
        mine = trainer_logprobs(model, p, c.token_ids, 1.0)
        assert (mine - torch.tensor(c.logprobs)).abs().max().item() < 1e-4
    assert len(eng.score(prompts[0] + outs[0].token_ids)) == len(prompts[0] + outs[0].token_ids) - 1


@pytest.mark.engine
def test_a_dead_replica_surfaces_within_seconds(two_replicas):
    eng = two_replicas
    futs = [eng.submit([5, 6, i], SamplingConfig(max_tokens=200, ignore_eos=True), seed=i) for i in range(2)]
    t0 = time.monotonic()
    for pid in eng.replica_pids[1]:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineError, match="replica 1 of 2.*died") as info:
        for f in futs:  # one request per replica (distinct prompts, least loaded)
            eng.wait_result(f, timeout=60)
    elapsed = time.monotonic() - t0
    print(f"FAULT-TIMING replica 1 SIGKILL -> EngineError in {elapsed:.2f} s: {info.value}")
    assert elapsed < 15
