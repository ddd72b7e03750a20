"""Partial rollout (non-strict sync): over-provision each iteration, train on the first P groups.

Each iteration tops the engine up to ceil(alpha * P) groups (carried-over ones included) and
ends at the P-th complete group; the unfinished ones carry over, first in line, by
``inflight``: ``keep`` (generation continues across the weight update) or ``abort``
(resubmitted as prompt + partial response). Built on ``StreamingRollout``: the same buffer,
staleness policies and selection rules, topped up only at the start of an iteration.

``over_provision=auto`` sizes alpha from the engine: ``1 + ceil(concurrency / G) / P``, i.e.
the engine's concurrency in groups plus the batch the iteration trains (at most 3, and at most
1 + K under a staleness bound K). With less, the engine runs below capacity once the first
groups of an iteration finish (nothing is topped up until the next one); with more, the extra
groups only queue. Nothing is dropped, so the trained mix is the issued one. The price is
staleness, about alpha - 1 versions on average. Near the bound of a generation-bound pipeline
that is unavoidable: every sample generating when the weights change gains a version, a full
engine holds ``concurrency`` of them, and a version trains P G, so the mean staleness of an
unbiased pipeline at that bound is at least concurrency / (P G) = alpha - 1
(``tools.pipeline`` prints this floor). Simulator (``python -m tools.plan``): 0.94-0.98
of the pipeline bound at mean staleness 1.97-1.98 on the seed, lognormal and bimodal workloads,
where alpha = 2 reaches 0.48-0.65. When training is the bottleneck auto keeps more outstanding
than needed (same throughput, more staleness; set alpha by hand there). The cap at 3 keeps an
engine far larger than the batch (a 4 x 4 test batch on 256 slots would get alpha 17) from
making the staleness large; such a pipeline then reaches about 2 P G / concurrency of its
bound. Without a known concurrency alpha is 2.
"""

from __future__ import annotations

import math
from typing import Literal

from data.rollout.controller import RolloutContext, RolloutController
from data.rollout.shaping import InformativeGroups, Overlong
from data.rollout.staleness import StalenessPolicy
from data.rollout.streaming import StreamingRollout
from modules.config.errors import check
from modules.engine.types import SamplingConfig

# auto's alpha is at most 1 + this: mean staleness about 2 versions, whatever the engine's size.
AUTO_MAX_EXTRA = 2


class PartialRollout(StreamingRollout):
    """Non-strict sync: issue ceil(alpha * P) groups per iteration, train on the first P."""

    def __init__(
        self,
        prompts_per_step: int,
        group_size: int,
        sampling: SamplingConfig,
        over_provision: float | Literal["auto"] = 2.0,
        inflight: str = "keep",
        max_staleness: int | None = None,
        staleness: StalenessPolicy | None = None,
        wait_timeout_s: float = 600.0,
        group_filter: InformativeGroups | None = None,
        overlong: Overlong | None = None,
    ) -> None:
        check(
            "rollout.over_provision",
            over_provision,
            over_provision == "auto"
            or (
                isinstance(over_provision, int | float)
                and not isinstance(over_provision, bool)
                and 1.0 <= over_provision < math.inf
            ),
            "auto (engine concurrency in groups + one batch) or a finite float >= 1 (alpha)",
        )
        self.over_provision = over_provision
        n = math.ceil((2.0 if over_provision == "auto" else over_provision) * prompts_per_step)
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
            cancel_doomed=False,  # K is loose here (default None: unbounded): nothing is doomed
            group_filter=group_filter,
            overlong=overlong,
        )
        self._iteration_open = False

    def groups_per_iteration(self, concurrency: int | None) -> int:
        """ceil(alpha P): the configured alpha, or ``auto``'s: P + the engine's concurrency in
        groups, at most ``AUTO_MAX_EXTRA`` P and at most K P (a bound K on staleness makes
        groups more than K batches ahead stale on arrival)."""
        p = self.prompts_per_step
        if self.over_provision != "auto":
            return math.ceil(self.over_provision * p)
        if not concurrency:
            return 2 * p
        extra = min(math.ceil(concurrency / self.group_size), int(AUTO_MAX_EXTRA) * p)
        k = self.max_staleness
        return p + (extra if k is None else min(extra, k * p))

    def alpha(self, concurrency: int | None) -> float:
        """The over-provisioning factor for ``concurrency`` (the configured one unless auto)."""
        return self.groups_per_iteration(concurrency) / self.prompts_per_step

    def bind(self, ctx: RolloutContext) -> None:
        self.max_inflight = self.buffer_capacity = self.groups_per_iteration(ctx.engine.concurrency)
        super().bind(ctx)

    def _resize(self) -> None:
        """A new bound (``modules.callbacks.drift_controller``) also resizes auto's over-provisioning."""
        if self.ctx is not None:
            self.max_inflight = self.buffer_capacity = self.groups_per_iteration(self.ctx.engine.concurrency)
        super()._resize()

    def check_advantage(self, advantage: object) -> None:
        # Iterations count whole groups: responses are never released one by one here; the
        # staleness policy may refuse more (its own start-up check runs too).
        RolloutController.check_advantage(self, advantage)
        self.bound.policy.check_advantage(advantage)

    def _target_inflight(self) -> int:
        # Top up only at the start of an iteration (not continuously, unlike streaming).
        if not self._iteration_open:
            return 0
        return self._sizing.inflight - len(self._buffer)

    def _replace_refused(self) -> None:
        # Top-ups happen only at an iteration's start: replace a refused group at once, so
        # the iteration still reaches P informative groups.
        if not self._closed and self._error is None:
            self._start_group()

    def _replace_regenerated(self) -> None:
        # A group regenerated mid-iteration (the bound lowered at run time): start groups at once
        # while the iteration cannot reach P, as the top-up that would do it comes only next time.
        while (
            not self._closed
            and self._error is None
            and len(self._buffer) + len(self._groups) < self.prompts_per_step
        ):
            self._start_group()

    def _start_iteration(self) -> None:
        self._iteration_open = True
        self._top_up()
        self._iteration_open = False
