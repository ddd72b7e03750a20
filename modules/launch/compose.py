"""The Hydra config outside ``@hydra.main``: compose it as ``train.py`` does, build objects from it.

cfg = compose(["recipe=async_grpo", "seed=1"])      # tests, tools, lab
datamodule = build(cfg.data)                        # train.py, tests
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from modules.launch.config_errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def compose(overrides: list[str] | None = None, output_dir: str = "/tmp/asyncrl") -> DictConfig:
    """``conf/train.yaml`` composed with ``overrides`` as ``train.py`` composes it, without a
    Hydra run (``output_dir`` is only a string in the config; nothing here writes to it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return hydra_compose(
                "train",
                overrides=[f"paths.root_dir={ROOT}", f"paths.output_dir={output_dir}", *(overrides or [])],
            )
    finally:
        GlobalHydra.instance().clear()


def build(cfg: DictConfig, **kwargs: Any) -> Any:
    """``instantiate`` that surfaces our ConfigError (naming the field) instead of Hydra's wrapper."""
    try:
        return instantiate(cfg, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from None
        raise
