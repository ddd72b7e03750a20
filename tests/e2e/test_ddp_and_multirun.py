"""``trainer.devices=2`` (gloo) and ``python train.py -m``: disjoint shards that agree with the
engine, each multirun job once (also under DDP), no leak from job to job."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.runs import (
    multirun,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ddp_sweep(tmp_path_factory, models) -> Path:
    """One ``train.py -m seed=0,1 trainer.devices=2`` sweep of 3 steps a job, shared by the DDP
    tests below (each DDP job costs an engine start-up and a relaunched rank)."""
    sweep = tmp_path_factory.mktemp("ddp_sweep")
    multirun(
        sweep,
        models,
        f"trainer.max_steps={DDP_STEPS}",
        "trainer.devices=2",
        "seed=0,1",
        "+callbacks.zz_probe._target_=tests.ddp_probe.DumpRankWeights",
    )
    return sweep


DDP_STEPS = 3


def test_ddp_two_ranks_train_disjoint_shards_and_agree_with_the_engine(ddp_sweep, models):
    """trainer.devices=2 on the CPU (gloo): rank 0 owns the engine and scatters each rollout
    batch; both ranks train on disjoint halves and end with identical weights, which are the
    weights the engine serves."""
    steps, run_dir = DDP_STEPS, ddp_sweep / "0"
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    train_rows = [r for r in rows if r["train/loss"]]
    assert [int(r["step"]) for r in train_rows] == list(range(steps))
    assert all(float(r["perf/rank_weight_max_diff"]) == 0.0 for r in train_rows)
    # 4 prompts x 4 samples per rollout batch: each rank trained 8, no sample on both ranks
    full = [json.loads(x) for x in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    shards = {
        r: [json.loads(x) for x in (run_dir / f"trained_samples.rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    }
    assert len(full) == len(shards[0]) == len(shards[1]) == steps
    for k in range(steps):
        a = {tuple(s) for s in shards[0][k]["samples"]}
        b = {tuple(s) for s in shards[1][k]["samples"]}
        assert len(a) == len(b) == 8 and not a & b
        assert a | b == {tuple(s) for s in full[k]["samples"]}
    # identical weights on both ranks, changed by training, equal to the engine's
    w0 = torch.load(run_dir / "weights.rank0.pt")
    w1 = torch.load(run_dir / "weights.rank1.pt")
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    before = load_file(models["tied"] / "model.safetensors")
    assert any((before[k] - w0[k]).abs().max() > 0 for k in before)
    engine = json.loads((run_dir / "engine_diff.json").read_text())
    assert engine["engine_version"] == steps and engine["engine_max_abs_diff"] < 1e-4


def test_multirun_of_three_jobs_leaks_no_threads_processes_or_memory(tmp_path, models):
    """``python train.py -m`` runs its jobs one after another in one process: after each job
    the engine is gone (0 children), the thread count is back to where it was, and the
    resident memory does not keep growing from job to job (three jobs: the first pays one-off
    imports, the second and third must agree)."""
    multirun(tmp_path, models, "trainer.max_steps=2", "seed=0,1,2")
    footprints = []
    for job in range(3):
        line = next(
            x
            for x in (tmp_path / str(job) / "train.log").read_text().splitlines()
            if "process after job" in x
        )
        footprints.append(dict(kv.split("=") for kv in line.split("process after job: ")[1].split()))
    assert [int(f["children"]) for f in footprints] == [0, 0, 0]
    threads = [int(f["threads"]) for f in footprints]
    assert threads == [threads[0]] * 3, threads
    rss = [int(f["rss_mb"]) for f in footprints]
    # the first job pays one-off imports; after it (heap trimmed after each job) no trend
    assert rss[2] - rss[1] < 50, rss


def test_multirun_with_ddp_trains_each_job_once_on_two_ranks(ddp_sweep):
    """``-m seed=0,1 trainer.devices=2``: Lightning relaunches rank 1 from ``sys.argv``, which in
    a multirun still holds the sweep (``modules/launch/multirun.py``); each job must run once, on two
    ranks, in its own directory (a job run twice would log twice its steps)."""
    assert sorted(p.name for p in ddp_sweep.iterdir() if p.is_dir()) == ["0", "1"]
    for job in ("0", "1"):
        for rank in (0, 1):
            lines = (ddp_sweep / job / f"trained_samples.rank{rank}.jsonl").read_text().splitlines()
            assert len(lines) == DDP_STEPS, (job, rank, lines)
