"""Start-up checks against this machine: files that must exist and resources it must have.

Run by ``train.py`` after the config rules (``validate.py``) and before anything is built, so
a wrong path or a resource this machine lacks fails in seconds, naming the field, instead of
after the engine started. Kept apart from ``validate`` because the answer depends on the
machine, not only on the config.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from modules.config_errors import check
from modules.engine.placement import names_cores, parse_cores
from modules.policy import is_hub_id


def check_environment(cfg: DictConfig) -> None:
    ckpt = cfg.get("ckpt_path")
    if ckpt is not None and ckpt not in ("last", "best", "hpc", "registry"):  # Lightning's names
        check("ckpt_path", ckpt, Path(str(ckpt)).is_file(), "null, last, or an existing checkpoint file")
    if not str(cfg.module.get("_target_", "")).endswith("GRPOModule"):
        return  # the SFT recipe builds its model when the directory is empty
    for field in ("module.model_path", "module.ref_model_path"):
        path = OmegaConf.select(cfg, field)
        if path is not None:
            check(
                field,
                path,
                is_hub_id(path) or Path(str(path), "config.json").is_file(),
                "a model directory (with config.json) or a hub id; the RL recipes start from "
                "the SFT warm start: run `make sft` first",
            )
    _check_context_length(cfg)
    _check_machine(cfg)


def _check_context_length(cfg: DictConfig) -> None:
    """vLLM refuses an ``engine.max_model_len`` beyond the model's positions (at engine start)."""
    path = Path(str(cfg.module.model_path), "config.json")
    if not path.is_file():
        return  # a hub id: its config is only known once downloaded
    import json

    positions = json.loads(path.read_text()).get("max_position_embeddings")
    if isinstance(positions, int):
        check(
            "engine.max_model_len",
            cfg.engine.max_model_len,
            cfg.engine.max_model_len <= positions,
            f"<= {positions}, the max_position_embeddings of {cfg.module.model_path}",
        )


def _check_machine(cfg: DictConfig) -> None:
    engine, trainer = cfg.engine, cfg.trainer
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    cores = engine.get("cpu_cores")
    if engine.get("gpu_ids") is None and names_cores(cores) and usable is not None:
        try:
            wanted = parse_cores(str(cores))
        except ValueError:
            wanted = None
        check(
            "engine.cpu_cores",
            cores,
            wanted is not None and bool(wanted) and wanted <= set(usable),
            f"cores this process may use ({','.join(map(str, usable))}), e.g. '1' or '0-3'",
        )
        if engine.get("pin_trainer", True):
            check(
                "engine.cpu_cores",
                cores,
                bool(set(usable) - wanted),
                f"a subset that leaves the trainer a core (usable: {usable}), or engine.pin_trainer=false",
            )
    kv = engine.get("cpu_kvcache_gb")
    if engine.get("gpu_ids") is None and isinstance(kv, int):
        import psutil

        total_gb = psutil.virtual_memory().total / 2**30
        check("engine.cpu_kvcache_gb", kv, 0 < kv < total_gb, f"an int in [1, {int(total_gb)}) (GiB of RAM)")
    wants_gpu = trainer.get("accelerator") in ("gpu", "cuda") or engine.get("gpu_ids") is not None
    if wants_gpu:
        import torch

        n = torch.cuda.device_count()
        field = "trainer.accelerator" if trainer.get("accelerator") in ("gpu", "cuda") else "engine.gpu_ids"
        check(field, OmegaConf.select(cfg, field), n > 0, "cpu on a machine without a CUDA GPU")
        ids = list(engine.gpu_ids) if OmegaConf.is_list(engine.get("gpu_ids")) else []
        check(
            "engine.gpu_ids", ids, all(0 <= i < n for i in ids), f"GPU ids below {n} (GPUs on this machine)"
        )
