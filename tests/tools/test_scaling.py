"""lab/scaling.py: the weight-sync cost model, the engine/trainer split and the simulator's
sync cost, against hand values; a smoke run of the benchmark."""

from __future__ import annotations

import json
import math

import pytest
from hydra.utils import instantiate

from lab.scaling import main
from lab.scaling_costs import (
    Gpu,
    Model,
    broadcast_time,
    decode_rate,
    gpu_split,
    place,
    push_time,
    sync_cost,
    weight_bytes,
)
from modules.engine.sim import SimEngine
from modules.engine.types import SamplingConfig
from tests.conftest import compose
from tools.pipeline import bounds, pause, simulate


def test_weight_bytes_and_push_vs_broadcast_by_hand():
    nbytes = weight_bytes(7e9)  # bf16
    assert nbytes == 14e9
    assert weight_bytes(7e9, 4) == 28e9
    # push: every replica gets its own copy over the trainer's one link
    assert push_time(nbytes, 1, 50e9) == pytest.approx(0.28)
    assert push_time(nbytes, 4, 50e9, latency=1e-3) == pytest.approx(4 * (0.28 + 1e-3))
    # pipelined broadcast: the bytes cross once; depth ceil(log2(4 + 1)) = 3 hops of latency + chunk
    chunk = 4 * 2**20
    assert broadcast_time(nbytes, 4, 50e9, 1e-5, chunk) == pytest.approx(0.28 + 3 * (1e-5 + chunk / 50e9))
    assert broadcast_time(nbytes, 1, 50e9) == pytest.approx(0.28 + chunk / 50e9)


def test_sync_cost_push_grows_with_replicas_broadcast_does_not():
    gpu = Gpu("toy", 1e15, 1e12, 80e9, nvlink_bytes_per_s=400e9, nic_bytes_per_s=40e9)
    model = Model("toy 10B", 10e9, 10, 1000, 1)  # 20 GB in bf16
    push = [sync_cost(model, r, 1, gpu, "push", "ib", fixed_s=0.5) for r in (1, 8, 64)]
    tree = [sync_cost(model, r, 1, gpu, "tree", "ib", fixed_s=0.5) for r in (1, 8, 64)]
    assert push == pytest.approx([0.5 + r * (0.5 + gpu.ib_latency_s) for r in (1, 8, 64)])
    assert tree[0] == pytest.approx(push[0], rel=1e-3)
    assert tree[-1] < 1.01 and tree[-1] - tree[0] < 1e-3  # 20 GB / 40 GB/s + 6 more hops
    assert sync_cost(model, 4, 1, gpu, "tree", "nvlink", fixed_s=0.0) == pytest.approx(0.05, rel=1e-3)


def test_gpu_split_by_hand():
    # 1B params (2 GB), kv 2 x 10 layers x 1 head x 100 x 2 B = 4 kB per token; every response
    # 1,000 tokens, no prompt: decoding context 1000^2 / (2 x 1000) = 500 tokens = 2 MB of KV
    model = Model("toy 1B", 1e9, 10, 1000, 1, head_dim=100)
    gpu = Gpu("toy", 1e16, 1e12, 10e9)
    kw = {"hbm_eff": 1.0, "mem_util": 1.0, "max_num_seqs": 10**6, "overhead_s": 0.0}
    dec = decode_rate(model, gpu, 500, tp=1, **kw)
    assert dec["batch"] == 4000  # (10 GB - 2 GB) / 2 MB
    assert dec["a_s"] == pytest.approx(2e-3)  # 2 GB of weights / 1 TB/s
    assert dec["b_s"] == pytest.approx(2e-6)  # 2 MB of KV / 1 TB/s (above the FLOPs: 0.4 us)
    assert dec["tokens_per_s"] == pytest.approx(4000 / (2e-3 + 4000 * 2e-6))  # 400,000
    s = gpu_split(model, [(1000, 1.0)], gpu, prompt_tokens=0, tp=1, mfu=0.4, **kw)
    assert s["gen_gpu_s_per_sample"] == pytest.approx(1000 / 400_000)
    # (3 + 1 recompute) forward passes of 2 N S + 2 layers d S^2
    flops = 4 * (2e9 * 1000 + 2 * 10 * 1000 * 1000**2)
    assert s["train_flops_per_sample"] == pytest.approx(flops)
    assert s["train_gpu_s_per_sample"] == pytest.approx(flops / 4e15)
    assert s["engine_share"] == pytest.approx(2.5e-3 / (2.5e-3 + flops / 4e15))


def test_place_keeps_trainer_nodes_whole_and_replicas_whole():
    assert place(64, 0.629, 1) == {"gpus": 64, "trainer_gpus": 24, "replicas": 40, "tp": 1, "engine_gpus": 40}
    p = place(256, 0.5, 8)
    assert p["trainer_gpus"] % 8 == 0 and p["engine_gpus"] == 8 * p["replicas"] <= 256 - p["trainer_gpus"]
    assert place(8, 0.5, 1)["trainer_gpus"] == 4  # one node: any count


def test_pause_stops_decoding_and_counts_as_idle():
    eng = SimEngine(max_concurrency=4)
    fut = eng.submit([ord(c) for c in "10|"], SamplingConfig(max_tokens=100), request_id="g0-s0")
    eng.advance_to(4.0)
    pause(eng, 5.0)
    assert eng.now == 9.0 and not fut.done()
    eng.advance()
    assert eng.now == pytest.approx(15.0)  # 10 tokens of decoding + 5 paused
    assert eng.busy_time == pytest.approx(10.0)


def _controller(mode: str, *overrides: str):
    cfg = compose([f"rollout={mode}", "rollout.prompts_per_step=32", "rollout.group_size=1", *overrides])
    return instantiate(cfg.rollout)


def test_sync_time_lengthens_a_sync_iteration_by_exactly_itself():
    # every response 10 units, 32 of 64 slots, a step of 5: an iteration 10 + 5 (+ 5 of sync)
    base = simulate(_controller("sync"), [(10, 1.0)], steps=50, step_time=5.0, concurrency=64)
    paid = simulate(_controller("sync"), [(10, 1.0)], steps=50, step_time=5.0, concurrency=64, sync_time=5.0)
    assert base["samples_per_unit"] == pytest.approx(32 / 15, rel=0.02)
    assert paid["samples_per_unit"] == pytest.approx(32 / 20, rel=0.02)
    assert paid["sync_frac"] == pytest.approx(5 / 20, rel=0.02)
    assert paid["samples_per_unit"] == pytest.approx(
        bounds([(10, 1.0)], 32, 64, 5.0, sync_time=5.0)["sync_samples_per_unit"], rel=0.02
    )


def test_streaming_with_sync_time_reaches_the_bound_that_counts_it():
    # trainer-bound: 32 samples per 10 + 5 units; the engine (64 slots / 10 units, paused 5 per
    # version) could feed 1 / (10 / 64 + 5 / 32) = 3.2
    ctl = _controller(
        "streaming", "rollout.max_inflight=64", "rollout.buffer_capacity=128", "rollout.max_staleness=10"
    )
    out = simulate(ctl, [(10, 1.0)], steps=200, step_time=10.0, concurrency=64, sync_time=5.0)
    b = bounds([(10, 1.0)], 32, 64, 10.0, sync_time=5.0)
    assert b["pipeline_bound_samples_per_unit"] == pytest.approx(32 / 15)
    assert out["samples_per_unit"] == pytest.approx(32 / 15, rel=0.02)
    assert out["trainer_idle_frac"] < 0.02


def test_scaling_smoke(tmp_path, capsys):
    plot = tmp_path / "scaling.png"
    result = main(["--smoke", "--plot", str(plot), "--out", str(tmp_path / "r.json")])
    assert plot.stat().st_size > 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["sim_model"] == result["sim_model"]
    shm = result["shm"]
    assert len(shm["points"]) == 6 and shm["bandwidth_bytes_per_s"] > 0
    (sim,) = result["simulated"]
    modes = {(r["sync"], r["mode"]) for r in sim["rows"]}
    assert modes == {(h, m) for h in ("tree", "push") for m in ("sync", "partial", "streaming K=2")}
    for row in sim["rows"]:
        assert row["samples_per_s"] > 0 and 0 <= row["drop_rate"] < 1 and math.isfinite(row["staleness_mean"])
    assert {r["key"] for r in result["ratio"]} == {"7b", "32b", "70b"}
