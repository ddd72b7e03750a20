"""Freezing a recipe into a fork, as the README tells users to: ``--cfg job --resolve`` into a
primary config, then ``--config-name``. The frozen file pins every value, still writes each run
to its own output dir, takes overrides, and passes the start-up checks."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml
from omegaconf import OmegaConf

from modules.config.schema import check_types
from modules.launch.validate import validate
from tests.conftest import ROOT


def user_env() -> dict[str, str]:
    """The environment a user's shell has: no PROJECT_ROOT (the Makefile and conftest set it)."""
    return {k: v for k, v in os.environ.items() if k != "PROJECT_ROOT"}


def train_py(*args: str, cwd=ROOT) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        env=user_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_frozen_recipe_runs_as_its_own_config(tmp_path):
    frozen = train_py("recipe=async_grpo", "--cfg", "job", "--resolve")
    (tmp_path / "my_async.yaml").write_text(frozen)
    cfg = yaml.safe_load(frozen)
    # every run-time output path stays this run's dir, not a value frozen at print time
    assert cfg["paths"]["output_dir"] == "${hydra:runtime.output_dir}"
    assert cfg["callbacks"]["checkpoint"]["dirpath"] == "${hydra:runtime.output_dir}/checkpoints"
    assert cfg["trainer"]["default_root_dir"] == "${hydra:runtime.output_dir}"
    # values are pinned: no interpolation left besides the run dir
    assert "${" not in frozen.replace("${hydra:runtime.output_dir}", "")
    assert cfg["rollout"]["max_staleness"] == 4

    # run as its own primary config, with an override: the same config, the override applied
    again = train_py(
        "--config-path", str(tmp_path), "--config-name", "my_async", "rollout.max_staleness=2",
        "--cfg", "job",
    )  # fmt: skip
    assert yaml.safe_load(again) == {**cfg, "rollout": {**cfg["rollout"], "max_staleness": 2}}

    # and it passes the start-up checks train.py runs (output dir as a run would set it)
    loaded = OmegaConf.load(tmp_path / "my_async.yaml")
    loaded.paths.output_dir = str(tmp_path / "run")
    check_types(loaded)
    validate(loaded)
