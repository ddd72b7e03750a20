"""The GPU smoke script cannot run here; what can: it stops at once, exit 2, with a report
that says why, and its runs are the GPU configs the README documents."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import compose
from tools.gpu_smoke import command, outcome


def test_each_run_is_a_placed_gpu_config():
    from modules.engine.gpus import place_gpus

    cmd = command("async_grpo", 3, 2, 1, Path("/tmp/x"))
    overrides = [a for a in cmd[2:] if not a.startswith("hydra.")]
    cfg = compose(overrides)
    assert cfg.trainer.accelerator == "gpu" and cfg.engine.weight_transfer == "nccl"
    assert cfg.callbacks.weight_sync.verify is True and cfg.trainer.max_steps == 3
    p = place_gpus(cfg, device_count=3, env={})
    assert p.trainer == [0, 1] and p.engine == [2]


def test_a_run_passes_only_with_every_step_trained_and_a_verified_sync(tmp_path):
    (tmp_path / "metrics.csv").write_text(
        "step,train/loss,perf/weight_sync_max_abs_diff,perf/weight_sync_s,perf/samples_per_s\n"
        "0,0.1,1e-6,0.2,10\n1,0.1,2e-6,0.2,11\n"
    )
    ok = outcome(tmp_path, 0, 2, "")
    assert ok["passed"] and ok["verify_max_abs_diff"] == 2e-6 and ok["samples_per_s"] == 11
    short = outcome(tmp_path, 0, 3, "log")
    assert not short["passed"] and short["log_tail"] == "log"
    assert not outcome(tmp_path, 1, 2, "boom")["passed"]
