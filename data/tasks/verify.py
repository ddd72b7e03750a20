"""Answer equivalence by math-verify (``math_verify``), shared by the GSM8K and MATH rewards.

``make install`` installs it (pinned in ``requirements-*.txt`` next to the ANTLR 4.9 runtime
that Hydra/OmegaConf need; installed on its own, math-verify may pull 4.13, which breaks them).
Without it ``math_verify_match`` returns None and each task falls back to its own comparison.

Timeouts: math_verify bounds ``parse`` and ``verify`` with ``signal.alarm``, which only a
process's main thread may set, while rewards here are scored on the engine's callback thread
(training), the trainer's main thread (evaluation) or a reward worker's main thread
(``data.reward_timeout_s``, ``data/rollout/rewards.py``). Its timeouts are therefore always off,
so an answer scores the same on every thread and no alarm is armed in the trainer; a
pathological answer is bounded by ``data.reward_timeout_s`` (the GSM8K and MATH recipes set
it), which kills the worker process and scores the call per ``data.reward_errors``.
"""

from __future__ import annotations

import logging


class _NoTimeoutWarning(logging.Filter):
    """Drop math_verify's once-per-process "Timeout is disabled" warning: the project's
    ``data.reward_timeout_s`` is the timeout it asks for."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


_FILTER = _NoTimeoutWarning()


def _quiet() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def math_verify_match(predicted: str, reference: str) -> bool | None:
    """Whether math_verify finds the final answer ``predicted`` equivalent to ``reference``
    (both extracted answers, e.g. the content of a ``\\boxed{}``); None if it is not installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    _quiet()
    gold = parse("\\boxed{" + reference + "}", parsing_timeout=None)
    pred = parse("\\boxed{" + predicted + "}", parsing_timeout=None)
    # verify(gold, target): not symmetric, the reference goes first.
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))
