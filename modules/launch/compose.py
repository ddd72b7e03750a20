"""The Hydra config outside ``@hydra.main``: compose it as ``train.py`` does, build objects from it.

cfg = compose(["recipe=async_grpo", "seed=1"])      # tests, tools, lab
datamodule = build(cfg.data)                        # train.py, tests
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from modules.config.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
RUN_OUTPUT_DIR = "${hydra:runtime.output_dir}"


def run_output_dir() -> str:
    """``paths.output_dir``: this run's Hydra output dir. Where a config is only printed
    (``--cfg job --resolve``: no run, no dir) it stays the interpolation itself, so a config
    frozen from that output writes each of its runs to that run's own dir."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf.errors import MissingMandatoryValue

    if HydraConfig.initialized():
        try:
            out = HydraConfig.get().runtime.output_dir
        except MissingMandatoryValue:  # --cfg: composed, never run
            out = None
        if out:
            return str(out)
    return RUN_OUTPUT_DIR


OmegaConf.register_new_resolver("run_output_dir", run_output_dir, replace=True)


def project_root() -> str:
    """``paths.root_dir``: ``$PROJECT_ROOT`` if set, else this checkout. Not Hydra's runtime cwd:
    a multirun resolves ``hydra.sweep.dir`` before any job has a runtime, and a run started
    from another directory still finds the project's artifacts."""
    return os.environ.get("PROJECT_ROOT") or str(ROOT)


OmegaConf.register_new_resolver("project_root", project_root, replace=True)


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
    """``instantiate`` that reports a failure as a ``ConfigError`` naming the field: ours as
    raised (it names it), another library's (Lightning's Trainer, a callback) under the key
    of this node its message mentions."""
    try:
        return instantiate(cfg, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from None
        raise ConfigError(blame(cfg, e.__cause__ or e)) from None


def blame(node: DictConfig, error: BaseException) -> str:
    """A message naming the key of ``node`` that ``error`` is about (the first one its text
    mentions as ``key=``, `` `key` `` or ``'key'``), with the value given."""
    path = node._get_full_key(None) if hasattr(node, "_get_full_key") else ""
    text = str(error).strip() or type(error).__name__
    for key in node.keys():
        if not isinstance(key, str) or key.startswith("_"):
            continue
        if any(f"{q}{key}{q2}" in text for q, q2 in (("", "="), ("`", "`"), ("'", "'"), ("(", "="))):
            try:
                value = node[key]
            except Exception:
                value = "?"
            value = OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value
            return f"invalid config value {path}.{key}={value!r}: {text}"
    return f"invalid config for {path or 'the run'}: {text}"
