"""DAPO's sample shaping: dynamic sampling (informative groups only) and overlong handling.

    python train.py recipe=dapo                               # both, with clip-higher
    python train.py rollout/group_filter=informative          # dynamic sampling alone
    python train.py rollout/overlong=soft rollout.overlong.buffer=64

* ``InformativeGroups`` (``rollout.group_filter``): a group whose G task rewards are all equal
  (judged before the overlong shaping below: for a 0/1 task, all right or all wrong, as DAPO
  filters on accuracy) has zero group advantage, so it adds no policy gradient but still fills the batch (and the
  token-mean's denominator). The filter refuses such groups; each mode replaces them: sync
  samples more groups until P informative ones are in (at most ``max_rounds`` extra rounds,
  sized by the informative rate seen so far; then the batch is topped up with refused groups,
  counted as ``rollout/filter_fill``); streaming and partial rollout start one new group for
  each refused one. ``rollout/filtered`` counts refused groups. Not for per-response
  advantages (a running baseline releases responses before their group is complete).
* ``Overlong`` (``rollout.overlong``): responses cut at ``max_tokens`` L. ``filter``: their
  loss mask is zeroed (they still count in their group's advantage, as in DAPO), so a
  truncated answer is neither rewarded nor punished for its unfinished text. ``buffer`` B > 0:
  soft punishment, ``penalty * ((L - B) - len) / B`` added to the reward when ``len > L - B``
  (0 at L - B, ``-penalty`` at L). DAPO also gives -1 beyond L; here the engine never
  generates beyond ``max_tokens``, so L is the hard cap. The task's own reward is kept in
  ``extras["task_reward"]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from data.envs.base import episode_budget
from modules.config.errors import check


class InformativeGroups:
    """Keep a group only if its rewards are not all equal (within ``eps``)."""

    def __init__(self, eps: float = 1e-6, max_rounds: int = 4) -> None:
        check("rollout.group_filter.eps", eps, isinstance(eps, int | float) and eps >= 0, "a float >= 0")
        check(
            "rollout.group_filter.max_rounds",
            max_rounds,
            isinstance(max_rounds, int) and max_rounds >= 0,
            "an int >= 0 (extra sampling rounds in sync mode)",
        )
        self.eps = eps
        self.max_rounds = max_rounds

    def keep(self, rewards: Sequence[float]) -> bool:
        return len(rewards) > 1 and max(rewards) - min(rewards) > self.eps

    @staticmethod
    def extra_groups(need: int, kept: int, seen: int, cap: int) -> int:
        """Groups to sample for ``need`` more informative ones, at the informative rate seen so
        far (kept / seen; at least 1 / 4 when nothing was informative yet), at most ``cap``."""
        rate = max(kept / seen if seen else 1.0, 0.25)
        return max(1, min(cap, math.ceil(need / rate)))


def overlong_fits_budget(cfg: Any) -> None:
    """Cross-field rule of ``Overlong``: the soft punishment's buffer is below the response's
    budget (an episode's, ``env.max_total_tokens``, when it sets one)."""
    buffer = (cfg.rollout.get("overlong") or {}).get("buffer") or 0
    budget, field = episode_budget(
        (cfg.get("env") or {}).get("max_total_tokens"), cfg.rollout.sampling.max_tokens
    )
    if isinstance(buffer, int) and isinstance(budget, int) and buffer:
        check("rollout.overlong.buffer", buffer, buffer < budget, f"an int below {field}={budget}")


class Overlong:
    """Overlong filtering (mask truncated responses) and soft overlong punishment."""

    cross_field_rules: ClassVar[tuple[Callable[[Any], None], ...]] = (overlong_fits_budget,)

    def __init__(self, filter: bool = False, buffer: int = 0, penalty: float = 1.0) -> None:  # noqa: A002
        check("rollout.overlong.filter", filter, isinstance(filter, bool), "true or false")
        check(
            "rollout.overlong.buffer", buffer, isinstance(buffer, int) and buffer >= 0, "an int >= 0 (tokens)"
        )
        check(
            "rollout.overlong.penalty",
            penalty,
            isinstance(penalty, int | float) and penalty >= 0,
            "a float >= 0",
        )
        self.filter, self.buffer, self.penalty = filter, buffer, float(penalty)

    def check_fits(self, max_tokens: int) -> None:
        check(
            "rollout.overlong.buffer",
            self.buffer,
            self.buffer < max_tokens,
            f"an int below the response's token budget ({max_tokens})",
        )

    def length_penalty(self, length: int, max_tokens: int) -> float:
        """The soft punishment (<= 0) of a response of ``length`` tokens."""
        if self.buffer == 0:
            return 0.0
        start = max_tokens - self.buffer
        return -self.penalty * min(max(length - start, 0), self.buffer) / self.buffer

    def mask(self, truncated: bool, length: int) -> list[int] | None:
        """The loss mask for a response (None: keep the default, every token)."""
        return [0] * length if self.filter and truncated else None
