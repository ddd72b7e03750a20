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
