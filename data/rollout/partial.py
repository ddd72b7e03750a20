"""Partial rollout (non-strict sync): over-provision each iteration, train on the first P groups.

Each iteration tops the engine up to ceil(alpha * P) groups (carried-over ones included) and
ends at the P-th complete group; the unfinished ones carry over, first in line, by
``inflight``: ``keep`` (generation continues across the weight update) or ``abort``
(resubmitted as prompt + partial response). Built on ``StreamingRollout``: the same buffer,
staleness policies and selection rules, topped up only at the start of an iteration.
"""

from __future__ import annotations

import math

from data.rollout.controller import RolloutController
from data.rollout.staleness import StalenessPolicy
from data.rollout.streaming import StreamingRollout
from modules.config_errors import check
from modules.engine.types import SamplingConfig


class PartialRollout(StreamingRollout):
    """Non-strict sync: issue ceil(alpha * P) groups per iteration, train on the first P."""

    def __init__(
        self,
        prompts_per_step: int,
        group_size: int,
        sampling: SamplingConfig,
        over_provision: float = 2.0,
        inflight: str = "keep",
        max_staleness: int = 1_000_000,
        staleness: StalenessPolicy | None = None,
        wait_timeout_s: float = 600.0,
    ) -> None:
        check("rollout.over_provision", over_provision, over_provision >= 1.0, "a float >= 1 (alpha)")
        self.over_provision = over_provision
        n = math.ceil(over_provision * prompts_per_step)
        super().__init__(
            prompts_per_step,
            group_size,
            sampling,
            max_inflight=n,
            max_staleness=max_staleness,
            staleness=staleness,
            buffer_capacity=n,
            inflight=inflight,
            wait_timeout_s=wait_timeout_s,
            cancel_doomed=False,  # K is loose here (default unbounded): nothing is doomed
        )
        self._iteration_open = False

    def check_advantage(self, advantage: object) -> None:
        # Iterations count whole groups: responses are never released one by one here.
        RolloutController.check_advantage(self, advantage)

    def _target_inflight(self) -> int:
        # Top up only at the start of an iteration (not continuously, unlike streaming).
        if not self._iteration_open:
            return 0
        return math.ceil(self.over_provision * self.prompts_per_step) - len(self._buffer)

    def _start_iteration(self) -> None:
        self._iteration_open = True
        self._top_up()
        self._iteration_open = False
