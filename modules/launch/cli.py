"""How ``train.py`` reports a bad config: one message, exit code 2, no traceback.

    python train.py rollout.group_size=-1
    config error: invalid config value rollout.group_size=-1: must be an int >= 1
    (HYDRA_FULL_ERROR=1 shows the traceback)

A config reaches ``train.py`` through Hydra, which reports its own composition errors (an
unknown group option, a key that is not in the config, an override it cannot parse) and
anything a job raises, through one function, ``hydra._internal.utils.run_and_report``: the
first with their message and exit code 1, the second with a trimmed traceback.
``report_config_errors`` wraps that function so that every config error (Hydra's, OmegaConf's,
a ``ConfigError`` from our checks or constructors, Hydra's failure to build a ``_target_``)
prints its message alone and exits ``EXIT_CONFIG``; a scheduler or a sweep script can then tell
"fix the command" (2) from a failed run (1) and an interrupted one (130 / 143). Everything else
keeps Hydra's report. ``HYDRA_FULL_ERROR=1`` (Hydra's own switch) shows every traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hydra.errors import (
    ConfigCompositionException,
    InstantiationException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf.errors import OmegaConfBaseException

from modules.config.errors import ConfigError

EXIT_CONFIG = 2
# Raised while composing the config or building its objects: the command is wrong, not the run.
CONFIG_ERRORS = (
    ConfigError,
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
    OmegaConfBaseException,
)


def full_error() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR", "") not in ("", "0")


def message(exc: BaseException) -> str:
    """The error's own words, with the cause Hydra wraps (OmegaConf's reason) when it adds one."""
    text = str(exc).strip()
    if isinstance(exc, OverrideParseException):  # Hydra's parser does not say which override
        overrides = [a for a in sys.argv[1:] if not a.startswith("-")]
        text = f"cannot parse the override(s) {' '.join(overrides)}: {text}"
    cause = exc.__cause__
    if isinstance(cause, OmegaConfBaseException) and str(cause).strip() not in text:
        text = f"{text}\n{str(cause).strip()}"
    return text


@contextmanager
def startup() -> Iterator[None]:
    """Around what ``train.py`` does before it builds an engine or a model: OmegaConf's errors,
    Hydra's failure to build a ``_target_`` (an unknown class, an argument it does not take) and
    Lightning's refusal of a Trainer argument are config errors there, one ``ConfigError``."""
    # imported here, not at the top: train.py imports this module at its top (see there)
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    try:
        yield
    except ConfigError:
        raise
    except (OmegaConfBaseException, InstantiationException, MisconfigurationException) as e:
        if full_error():
            raise
        raise ConfigError(message(e)) from None


def _report(run: Callable[[], Any]) -> Any:
    try:
        return run()
    except CONFIG_ERRORS as e:
        if full_error():
            raise
        sys.stderr.write(f"config error: {message(e)}\n(HYDRA_FULL_ERROR=1 shows the traceback)\n")
        sys.stderr.flush()
        raise SystemExit(EXIT_CONFIG) from None


def report_config_errors() -> None:
    """Make Hydra's reporting hook exit ``EXIT_CONFIG`` with one message on a config error.
    Idempotent; call before ``@hydra.main``'s function runs."""
    import hydra._internal.utils as hydra_utils

    original = hydra_utils.run_and_report
    if getattr(original, "reports_config_errors", False):
        return

    def run_and_report(func: Callable[[], Any]) -> Any:
        return original(lambda: _report(func))

    run_and_report.reports_config_errors = True  # type: ignore[attr-defined]
    hydra_utils.run_and_report = run_and_report


def launch(main: Callable[[], Any]) -> None:
    """``python train.py``: Lightning imported before Hydra sets up logging (so Lightning keeps
    its own console), config errors reported as above, and the exit of ``modules/launch/exit.py``
    (atexit handlers run, the interpreter's teardown skipped)."""
    import lightning  # noqa: F401

    from modules.launch.exit import exit_when_done

    report_config_errors()
    exit_when_done(main)
