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

from modules.engine.placement import names_cores, parse_cores
from modules.launch.config_errors import check
from modules.launch.schema import target_class
from modules.policy.hf_policy import is_hub_id


def check_environment(cfg: DictConfig) -> None:
    ckpt = cfg.get("ckpt_path")
    if ckpt is not None and ckpt not in ("last", "best", "hpc", "registry"):  # Lightning's names
        check("ckpt_path", ckpt, Path(str(ckpt)).is_file(), "null, last, or an existing checkpoint file")
    if not getattr(target_class(cfg.module), "needs_engine", False):
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
    _check_tensor_parallel(cfg)
    _check_machine(cfg)


def _model_config(cfg: DictConfig) -> dict | None:
    path = Path(str(cfg.module.model_path), "config.json")
    if not path.is_file():
        return None  # a hub id: its config is only known once downloaded
    import json

    return json.loads(path.read_text())


def _check_context_length(cfg: DictConfig) -> None:
    """vLLM refuses an ``engine.max_model_len`` beyond the model's positions (at engine start)."""
    positions = (_model_config(cfg) or {}).get("max_position_embeddings")
    if isinstance(positions, int):
        check(
            "engine.max_model_len",
            cfg.engine.max_model_len,
            cfg.engine.max_model_len <= positions,
            f"<= {positions}, the max_position_embeddings of {cfg.module.model_path}",
        )


def engine_tensor_parallel(engine: DictConfig) -> int:
    """GPUs per engine replica: the engine's GPUs (placed list, else ``num_gpus``) / replicas."""
    gpu_ids = engine.get("gpu_ids")
    if gpu_ids is None:
        return 1
    n = len(gpu_ids) if OmegaConf.is_list(gpu_ids) else int(engine.get("num_gpus", 1))
    return max(1, n // int(engine.get("replicas", 1)))


def tensor_parallel_problem(tp: int, heads: int | None, kv_heads: int | None) -> str | None:
    """Why vLLM would refuse tensor parallelism ``tp`` on a model (None: it fits). Attention
    heads split evenly across ranks; KV heads split evenly too, or, when fewer than the ranks,
    are replicated, which needs ``tp`` to be a multiple of them."""
    if heads is not None and heads % tp:
        return f"{heads} attention heads do not split over {tp} GPUs"
    if kv_heads is not None and (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
        return f"{kv_heads} KV heads neither split over {tp} GPUs nor replicate evenly onto them"
    return None


def _check_tensor_parallel(cfg: DictConfig) -> None:
    tp = engine_tensor_parallel(cfg.engine)
    model = _model_config(cfg)
    if tp == 1 or model is None:
        return
    heads = model.get("num_attention_heads")
    problem = tensor_parallel_problem(tp, heads, model.get("num_key_value_heads", heads))
    field = "engine.num_gpus" if cfg.engine.get("gpu_ids") == "auto" else "engine.gpu_ids"
    ok = [
        t
        for t in range(1, 65)
        if tensor_parallel_problem(t, heads, model.get("num_key_value_heads", heads)) is None
    ]
    check(
        field,
        OmegaConf.select(cfg, field),
        problem is None,
        f"GPUs per engine replica (engine GPUs / engine.replicas={cfg.engine.get('replicas', 1)}) "
        f"that {cfg.module.model_path} can be tensor-parallel over: one of {ok[:8]} ({problem})",
    )


def _check_machine(cfg: DictConfig) -> None:
    engine, trainer = cfg.engine, cfg.trainer
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    cores = engine.get("cpu_cores")
    if OmegaConf.is_list(cores):  # one spec per replica: the engines take their union
        cores = ",".join(str(c) for c in cores)
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
