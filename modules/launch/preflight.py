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

from modules.config.errors import check
from modules.config.resources import build_command, hub_problem, is_hub_id
from modules.config.schema import nodes, source_field, target_class
from modules.engine.placement import names_cores, parse_cores


def check_environment(cfg: DictConfig) -> None:
    ckpt = cfg.get("ckpt_path")
    if ckpt is not None and ckpt not in ("last", "best", "hpc", "registry"):  # Lightning's names
        check(
            "ckpt_path",
            ckpt,
            Path(str(ckpt)).is_file() and str(ckpt).endswith(".ckpt"),
            "null, last, or an existing Lightning checkpoint file (*.ckpt, e.g. checkpoints/last.ckpt)",
        )
    _check_output_dirs(cfg)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = cfg.get("torch_threads")
    if isinstance(threads, int) and usable:
        check(
            "torch_threads",
            threads,
            threads <= usable,
            f"an int in [1, {usable}] (cores this process may use)",
        )
    _check_datasets(cfg)
    rl = getattr(target_class(cfg.module), "needs_engine", False)
    # Every model the module loads (policy, reference, critic: keys ending in model_path); the
    # SFT recipe builds its model into an empty directory, so there it only must not be a file.
    for path, node in nodes(cfg.module, "module"):
        for key in node.keys():
            if isinstance(key, str) and key.endswith("model_path") and node.get(key) is not None:
                _check_model_path(source_field(cfg, f"{path}.{key}"), str(node[key]), required=rl)
    if not rl:
        return
    _check_context_length(cfg)
    _check_lora_rank(cfg)
    _check_tensor_parallel(cfg)
    _check_machine(cfg)


def _check_model_path(field: str, path: str, required: bool) -> None:
    """A model directory (with config.json), or a hub id this machine can load now; an
    existing file, or a directory without config.json, is never a model."""
    local = Path(path).expanduser()
    if local.is_file() and local.suffix.lower() == ".gguf":
        check(
            field,
            path,
            False,
            "a model directory (with config.json), not a GGUF file: import it into one with "
            "`python -m modules.policy.import_gguf <dir>` (`make smollm2` for SmolLM2-135M-Instruct)",
        )
    if not required:  # the SFT recipe builds a tiny model into an empty directory
        check(field, path, not local.is_file(), "a model directory (built there when empty), not a file")
        return
    if local.exists() or not is_hub_id(path):
        check(
            field,
            path,
            local.is_dir() and (local / "config.json").is_file(),
            "a model directory (with config.json) or a hub id; the RL recipes start from a "
            f"supervised warm start: build this one with {build_command(path)}",
        )
        return
    problem = hub_problem(path, "model")
    check(
        field,
        path,
        problem is None,
        f"a local model directory or a hub model this machine can load ({problem})",
    )


def _check_datasets(cfg: DictConfig) -> None:
    """Hub datasets a task names (its class lists the fields in ``hub_datasets``) must be on
    this machine or downloadable now, unless the task runs on its bundled examples."""
    task = cfg.get("task")
    if not isinstance(task, DictConfig) or task.get("offline"):
        return
    for key in getattr(target_class(task), "hub_datasets", ()):
        name = task.get(key)
        problem = hub_problem(str(name), "dataset") if name else None
        check(
            f"task.{key}",
            name,
            problem is None,
            f"a dataset this machine can load ({problem}): run once with network to cache it, give a "
            "local folder, or task.offline=true (the bundled examples)",
        )


def _check_output_dirs(cfg: DictConfig) -> None:
    """Where callbacks and loggers write: a directory, never an existing file."""
    for group in ("callbacks", "logger"):
        for name, node in (cfg.get(group) or {}).items():
            if not isinstance(node, DictConfig):
                continue
            for key in ("dirpath", "save_dir"):
                value = node.get(key)
                if isinstance(value, str):
                    field = source_field(cfg, f"{group}.{name}.{key}")
                    check(field, value, not Path(value).is_file(), "a directory (this path is a file)")


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


def _check_lora_rank(cfg: DictConfig) -> None:
    """A LoRA rank above the model's width adds parameters and no expressiveness."""
    rank = OmegaConf.select(cfg, "model.lora.rank")
    width = (_model_config(cfg) or {}).get("hidden_size")
    if isinstance(rank, int) and isinstance(width, int):
        check(
            "model.lora.rank",
            rank,
            rank <= width,
            f"0 (full fine-tuning) or an int <= {width}, the model's hidden_size",
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


def _check_trainer_threads(cfg: DictConfig, usable: int, engine_cores: int) -> None:
    """The trainer's threads fit beside a CPU engine: on the cores left to it when pinned, and
    on the cores the engine leaves free when generation overlaps training (a rollout without
    the sync barrier). Unpinned under sync, the trainer may take every core: the engine idles
    while it steps."""
    threads, pinned = cfg.get("torch_threads"), cfg.engine.get("pin_trainer", True)
    overlaps = not getattr(target_class(cfg.rollout), "barrier", False)
    if not isinstance(threads, int) or not (pinned or overlaps):
        return
    free = max(usable - engine_cores, 1)
    why = (
        f"the cores engine.cpu_cores={cfg.engine.cpu_cores} leaves the pinned trainer, or engine.pin_trainer=false"
        if pinned
        else "the cores the engine leaves free while generation overlaps training, or rollout=sync"
    )
    check("torch_threads", threads, threads <= free, f"an int in [1, {free}]: {why}")


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
        if wanted:
            _check_trainer_threads(cfg, len(usable), len(wanted & set(usable)))
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
