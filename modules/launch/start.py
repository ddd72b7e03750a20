"""Everything ``train.py`` does before ``fit``: place GPUs, validate, build every object. Nothing
here builds an engine or loads a model (both happen in ``fit``), so a bad value is refused in
seconds. ``tests/unit/test_bad_input_table.py`` and ``tools/bad_inputs.py`` run the same steps.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from modules.engine.gpus import place_gpus
from modules.launch.cli import startup
from modules.launch.compose import build


def build_run(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """The datamodule, the module and the Trainer of ``cfg``, after every start-up check; a bad
    value raises one ``ConfigError`` naming its field (``cli.startup``)."""
    import lightning as L
    import torch

    from modules.launch.preflight import check_environment
    from modules.launch.validate import validate

    with startup():
        place_gpus(cfg)  # on GPUs: which train, which generate (engine.gpu_ids: auto), or a split
        validate(cfg)  # types and cross-field rules; single-field ones run in the constructors below
        L.seed_everything(cfg.seed, workers=True)
        torch.set_num_threads(cfg.torch_threads)
        # cheap to construct, each validates its arguments; engine and model are built in fit()
        datamodule = build(cfg.data)
        module = build(cfg.module)
        callbacks = [build(c) for c in (cfg.get("callbacks") or {}).values()]
        loggers = [build(c) for c in (cfg.get("logger") or {}).values()]
        check_environment(cfg)  # files that must exist, cores / GPUs / memory this machine has
        datamodule.preflight((cfg.get("engine") or {}).get("max_model_len"))  # tokenizer, prompts
        trainer: L.Trainer = build(cfg.trainer, callbacks=callbacks, logger=loggers)
    return datamodule, module, trainer
