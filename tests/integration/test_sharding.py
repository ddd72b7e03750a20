"""Sharded training (FSDP2 via ``modules/policy/sharding.py``) on 2 CPU gloo ranks.

Trainer-level runs (``tests/sharding_run.py``: the real ``PolicyGradientModule``, ``WeightSync`` and
``SaveHFModel``, a fake engine that scores with a plain HF model of the pushed weights) compare
FSDP with DDP on the same batches; one end-to-end ``train.py trainer=fsdp_cpu`` run uses the real
engine. What does not run on the CPU (FSDP1, Lightning's ``strategy=fsdp``) is asserted with its
exact error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT


def run(out: Path, model: Path, strategy: str, *extra: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "tests.sharding_run",
        str(out),
        "--strategy",
        strategy,
        "--model",
        str(model),
    ]
    proc = subprocess.run([*cmd, *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {
        "losses": json.loads((out / "losses.json").read_text()),
        "held": [json.loads((out / f"numel.rank{r}.json").read_text()) for r in (0, 1)],
    }


def pushed(out: Path, version: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"pushed.v{version}.pt")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, models) -> dict:
    """4 steps (2 rollout batches x 2 minibatches) under FSDP and DDP, then each resumed from
    its own checkpoint for 2 more."""
    base = tmp_path_factory.mktemp("sharding")
    model = models["untied"]
    out = {}
    for strategy in ("fsdp", "ddp"):
        out[strategy] = run(base / strategy, model, strategy)
        ckpt = str(base / strategy / "last.ckpt")
        out[f"{strategy}_resumed"] = run(
            base / f"{strategy}_resumed", model, strategy, "--steps", "6", "--resume", ckpt
        )
    out["dir"], out["model"] = base, model
    return out


def test_parameters_and_optimizer_state_are_sharded(runs):
    for r, held in enumerate(runs["fsdp"]["held"]):
        assert held["params_local"] == held["params_total"] // 2, (r, held)
        assert held["optim_local"] == held["optim_total"] // 2, (r, held)
    for held in runs["ddp"]["held"]:  # DDP: every rank holds everything
        assert held["params_local"] == held["params_total"]
        assert held["optim_local"] == held["optim_total"]
    # rank 0 ran pi_old (Recompute) passes that rank 1 did not: forwards that would hang
    # under FSDP if each were a collective
    assert runs["fsdp"]["held"][0]["old_passes"] > 0 == runs["fsdp"]["held"][1]["old_passes"]


def test_the_gathered_push_equals_the_unsharded_weights(runs):
    """Version 0 is pushed at train start: the gathered shards must be the model on disk."""
    base, model = runs["dir"], runs["model"]
    disk = load_file(model / "model.safetensors")
    assert max_diff(pushed(base / "fsdp", 0), disk) == 0.0
    # the HF model SaveHFModel wrote (gathered on every rank, saved by rank 0) is the last push
    final = pushed(base / "fsdp", 2)
    assert max_diff(load_file(base / "fsdp" / "hf" / "model.safetensors"), final) == 0.0
    assert max_diff(final, disk) > 1e-3  # and training moved the weights


def test_fsdp_trains_like_ddp_and_the_engine_agrees(runs):
    base = runs["dir"]
    for name in ("fsdp", "fsdp_resumed"):
        f, d = runs[name]["losses"], runs[name.replace("fsdp", "ddp")]["losses"]
        assert [r["step"] for r in f] == [r["step"] for r in d]
        assert [r["version"] for r in f] == [r["version"] for r in d]
        for a, b in zip(f, d):
            assert abs(a["loss"] - b["loss"]) < 1e-5, (name, a, b)
            assert a["verify_diff"] < 1e-5  # the fake engine (plain model of the push) agrees
    # Adam turns float rounding (the reduction order differs) into weight differences of up
    # to ~1e-4 at lr 1e-2 on this peaky model; training itself moved the weights ~100x more
    moved = max_diff(pushed(base / "ddp", 2), pushed(base / "ddp", 0))
    assert max_diff(pushed(base / "fsdp", 2), pushed(base / "ddp", 2)) < 0.01 * moved


def test_resume_from_the_full_state_checkpoint(runs):
    """The checkpoint is one full-state file; the resumed run pushes exactly its weights first,
    continues the version, and (optimizer state restored) tracks DDP's resumed run."""
    base = runs["dir"]
    ckpt = torch.load(base / "fsdp" / "last.ckpt", weights_only=False)
    assert ckpt["asyncrl"]["policy_version"] == 2 and ckpt["global_step"] == 4
    assert all(not hasattr(t, "to_local") for t in ckpt["state_dict"].values())  # plain tensors
    assert max_diff(pushed(base / "fsdp_resumed", 2), pushed(base / "fsdp", 2)) == 0.0
    assert [r["step"] for r in runs["fsdp_resumed"]["losses"]] == [5, 6]
    moved = max_diff(pushed(base / "ddp_resumed", 3), pushed(base / "ddp", 0))
    assert max_diff(pushed(base / "fsdp_resumed", 3), pushed(base / "ddp_resumed", 3)) < 0.01 * moved


def test_fsdp1_does_not_run_on_the_cpu():
    """Lightning's strategy=fsdp and torch's FSDP1 refuse a CPU; FSDP2 (above) runs."""
    import lightning as L

    with pytest.raises(ValueError, match="The strategy `fsdp` requires a GPU accelerator"):
        L.Trainer(accelerator="cpu", devices=2, strategy="fsdp", logger=False)
    code = (
        "import os, torch, torch.distributed as dist\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29561')\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "FSDP(torch.nn.Linear(2, 2))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "FSDP needs a non-CPU accelerator device, but no accelerator device is detected" in proc.stderr
