"""Ranges of the arguments of the classes asyncrl builds but does not own: torch's optimizers
and Lightning's Trainer. Both would take a bad value and fail late (an optimizer is built in
``configure_optimizers``, after the engine started) or never (a negative clip norm flips the
gradient), so train.py checks them with the rest of the config, before anything is built.

Our own classes check their arguments in their constructors; this file is only for these two.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from modules.config.errors import ConfigError, check
from modules.config.schema import nodes, plain, target_class


def check_optimizers(cfg: DictConfig) -> None:
    """Every ``_partial_`` torch optimizer in the config is built once on a dummy parameter, so
    torch's own argument checks (lr >= 0, betas in [0, 1), eps >= 0, ...) run now; the field is
    the one that fails on its own (with the class's defaults for the others)."""
    import torch

    for path, node in nodes(cfg):
        cls = target_class(node)
        if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
            continue
        args = {k: plain(node[k]) for k in node.keys() if isinstance(k, str) and not k.startswith("_")}
        reason = _refusal(cls, args)
        if reason is None:
            continue
        for key, value in args.items():
            alone = _refusal(cls, {key: value})
            if alone is not None:
                raise ConfigError(f"invalid config value {path}.{key}={value!r}: {alone} ({cls.__name__})")
        raise ConfigError(f"invalid config value {path}: {reason} ({cls.__name__})")


def _refusal(cls: type, args: dict[str, Any]) -> str | None:
    """Why ``cls`` refuses ``args`` on a dummy parameter, or None."""
    import torch

    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **args)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v >= low


# Lightning Trainer arguments Lightning accepts out of range (or rejects only inside fit).
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
TRAINER_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "accelerator": (lambda v: v in ACCELERATORS, "one of " + ", ".join(ACCELERATORS)),
    "gradient_clip_val": (
        lambda v: v is None or _at_least(0)(v),
        "null or a number >= 0 (a negative norm would flip the gradient's sign)",
    ),
    "accumulate_grad_batches": (_at_least(1), "an int >= 1"),
    "log_every_n_steps": (lambda v: v is None or _at_least(1)(v), "null or an int >= 1"),
    "max_epochs": (lambda v: v is None or v == -1 or _at_least(1)(v), "-1 (no limit), null or an int >= 1"),
    "num_sanity_val_steps": (lambda v: v is None or _at_least(-1)(v), "-1 (all), 0 or an int >= 1"),
    "num_nodes": (_at_least(1), "an int >= 1"),
    "val_check_interval": (lambda v: v is None or (_at_least(0)(v) and v > 0), "null or a number > 0"),
    "limit_val_batches": (lambda v: v is None or _at_least(0)(v), "null or a number >= 0"),
    "limit_train_batches": (lambda v: v is None or (_at_least(0)(v) and v > 0), "null or a number > 0"),
}


def check_trainer(cfg: DictConfig) -> None:
    trainer = cfg.get("trainer")
    if not isinstance(trainer, DictConfig):
        return
    for key, (ok, allowed) in TRAINER_RANGES.items():
        if key in trainer:
            check(f"trainer.{key}", trainer[key], ok(trainer[key]), allowed)
