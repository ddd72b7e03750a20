"""Sharded training (FSDP2 via ``modules/policy/sharding.py``) on 2 CPU gloo ranks.

Trainer-level runs (``tests/sharding_run.py``: the real ``PolicyGradientModule``, ``WeightSync`` and
``SaveHFModel``, a fake engine that scores with a plain HF model of the pushed weights) compare
FSDP with DDP on the same batches; one end-to-end ``train.py trainer=fsdp_cpu`` run uses the real
engine. What does not run on the CPU (FSDP1, Lightning's ``strategy=fsdp``) is asserted with its
exact error.
"""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tests.conftest import ROOT, SHRINK


@pytest.mark.e2e
def test_train_py_with_fsdp_on_two_ranks_syncs_verified_weights(tmp_path, models):
    """``train.py recipe=sync_grpo trainer=fsdp_cpu``: real engine, 2 gloo ranks, 2 minibatches
    (so a pi_old pass), every sync verified by the engine scoring a trained sequence."""
    cmd = [sys.executable, "train.py", f"hydra.run.dir={tmp_path}", "recipe=sync_grpo", *SHRINK]
    cmd += [f"model.path={models['tied']}", "task._target_=tests.helpers.DigitShareTask"]
    cmd += ["trainer=fsdp_cpu", "trainer.max_steps=4", "algo.minibatches=2", "algo.loss.anchor=decoupled"]
    cmd += ["callbacks.weight_sync.verify=true", "data.eval_size=0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(tmp_path / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    assert [int(float(r["rollout/policy_version"])) for r in rows] == [0, 0, 1, 1]
    assert all(float(r["perf/weight_sync_max_abs_diff"]) < 1e-4 for r in rows[2:])
    assert "perf/rank_weight_max_diff" not in rows[0] or not rows[0]["perf/rank_weight_max_diff"]
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()  # a collective save under FSDP
    saved = load_file(tmp_path / "hf_model" / "model.safetensors")  # gathered, written by rank 0
    before = load_file(models["tied"] / "model.safetensors")
    assert saved.keys() == before.keys()
    assert any((before[k] - saved[k]).abs().max() > 0 for k in before)
