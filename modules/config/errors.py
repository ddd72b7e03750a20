"""Start-up validation: bad config values fail before any engine or model is built.

Constructors call ``check`` on their arguments; ``train.py`` instantiates every object
(cheap: nothing heavy happens in ``__init__``) before it builds the engine or loads a model.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value is invalid. The message names the field and the allowed values."""


def check(field: str, value: Any, ok: bool, allowed: str) -> None:
    """Raise ``ConfigError`` naming ``field`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"invalid config value {field}={value!r}: must be {allowed}")


def check_choice(field: str, value: Any, choices: list[str] | tuple[str, ...]) -> None:
    check(field, value, value in choices, "one of " + ", ".join(map(str, choices)))


def is_count(value: Any) -> bool:
    """An int >= 1 that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def batch_shape(cfg: Any) -> tuple[int, int, int, int] | None:
    """(P, G, minibatches, epochs) of an RL config when each is a count and the minibatches fit
    the rollout batch, else None: a bad value of one of them is reported by its own check, so
    rules that combine them stay quiet."""
    algo = cfg.algo
    shape = (
        cfg.rollout.prompts_per_step,
        cfg.rollout.group_size,
        algo.get("minibatches", 1),
        algo.get("epochs", 1),
    )
    if not all(is_count(v) for v in shape) or shape[2] > shape[0] * shape[1]:
        return None
    return shape


def world_size(cfg: Any) -> int:
    """DDP ranks of ``cfg.trainer``: devices (a count or a list) times nodes; 1 for 'auto'."""
    from omegaconf import OmegaConf

    devices = cfg.trainer.get("devices")
    world = len(devices) if OmegaConf.is_list(devices) else devices if is_count(devices) else 1
    return world * int(cfg.trainer.get("num_nodes") or 1)
