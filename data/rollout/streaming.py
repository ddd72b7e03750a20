"""Rollout without a global barrier: streaming (continuous generation, a buffer of groups).

``StreamingRollout`` keeps up to ``max_inflight`` groups generating. Each response is scored
as it finishes; a group enters the buffer when all G of its responses are in (a long response
delays only its own group), or, with ``algo/advantage=running``, each response on its own. ``next_batch`` returns as
soon as the batch selection rule (``selection.py``: FIFO, stratified, admission) has
``prompts_per_step`` groups. Every staleness decision (may a group start, is it dropped,
with what weight is it trained) is the ``StalenessBound``'s (``staleness.py``). ``PartialRollout`` (``partial.py``) is the
over-provisioned, non-strict synchronous variant built on this class.

Requests generating at a weight change (``inflight``): ``keep`` (in-flight update, spans record
which tokens came from which weights), ``abort`` (resubmit prompt + partial response, stitched)
or ``wait`` (a generation boundary).

Completion callbacks run on the engine's callback thread (``Engine.on_done``: never the
event loop that drives generation, so a slow reward cannot stall the engine or a weight
sync); all state is guarded by one re-entrant condition. Errors raised there (a reward
function, a dead engine) are stored and re-raised in the trainer's ``next_batch`` at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from data.rollout.bias import reweight_by_level
from data.rollout.controller import Pending, RolloutContext, RolloutController
from data.rollout.experience import Experience
from data.rollout.retirement import Retirement
from data.rollout.selection import BatchSelection, BatchView, Ready
from data.rollout.shaping import InformativeGroups, Overlong
from data.rollout.sizing import Sizing
from data.rollout.staleness import Drop, StalenessBound, StalenessPolicy
from data.rollout.streaming_state import StreamingCheckpoint
from modules.callbacks.interrupts import ctrl_c_held
from modules.config.errors import check, check_choice
from modules.engine.types import INFLIGHT_MODES, EngineError, SamplingConfig


@dataclass
class _Group:
    row: dict
    start_version: int
    started_at: float  # engine clock
    exps: list[Experience] = field(default_factory=list)


class StreamingRollout(StreamingCheckpoint, Retirement, RolloutController):
    def __init__(
        self,
        prompts_per_step: int,
        group_size: int,
        sampling: SamplingConfig,
        max_inflight: int | Literal["auto"] = 32,
        max_staleness: int | None = 1,
        staleness: StalenessPolicy | None = None,
        buffer_capacity: int | Literal["auto"] = 64,
        max_age_s: float | None = None,
        inflight: str = "keep",
        wait_timeout_s: float = 600.0,
        selection: BatchSelection | None = None,
        reweight: bool = False,
        cancel_doomed: bool = False,
        group_filter: InformativeGroups | None = None,
        overlong: Overlong | None = None,
    ) -> None:
        super().__init__(prompts_per_step, group_size, sampling, group_filter, overlong)
        check(
            "rollout.max_inflight",
            max_inflight,
            max_inflight == "auto" or (isinstance(max_inflight, int) and max_inflight >= 1),
            "auto (rate-matched up to the engine's concurrency) or an int >= 1 (groups)",
        )
        self.bound = StalenessBound(max_staleness, staleness or Drop(), prompts_per_step)
        check(
            "rollout.max_staleness",
            max_staleness,
            max_staleness is not None or "auto" not in (max_inflight, buffer_capacity),
            "an int >= 0 with auto sizing (null, unbounded, needs int rollout.max_inflight and "
            "rollout.buffer_capacity)",
        )
        check(
            "rollout.buffer_capacity",
            buffer_capacity,
            buffer_capacity == "auto"
            or (isinstance(buffer_capacity, int) and buffer_capacity >= prompts_per_step),
            f"auto or an int >= rollout.prompts_per_step ({prompts_per_step})",
        )
        check_choice("rollout.inflight", inflight, INFLIGHT_MODES)
        check("rollout.max_age_s", max_age_s, max_age_s is None or max_age_s > 0, "null or a float > 0")
        self.max_inflight = max_inflight
        self.cancel_doomed = cancel_doomed
        self.buffer_capacity = buffer_capacity
        self.max_age_s = max_age_s
        self.inflight = inflight
        check("rollout.wait_timeout_s", wait_timeout_s, wait_timeout_s > 0, "a float > 0 (seconds)")
        self.wait_timeout_s = wait_timeout_s
        self.selection = self.bound.policy.selection(selection)  # admit: its own rule
        self.bound.on_change(self._resize)
        # Buffer entries per group: 1 (whole groups), or G when a running-baseline advantage
        # releases responses one by one (set in bind, from the advantage).
        self._units_per_group = 1
        self.reweight = reweight
        self._trained_levels: dict = {}
        self._cv = threading.Condition(self.lock)
        self._requests: dict[cf.Future, Pending] = {}
        self._groups: dict[int, _Group] = {}
        self._buffer: deque[Ready] = deque()
        self._error: BaseException | None = None
        self._closed = False
        self.started_groups = 0
        self._refused_since_take = 0  # refused since the last batch
        # groups that left generation untrained (dropped, cancelled, refused), in groups: under
        # per-response release a dropped buffer unit is 1/G of a group (rate matching's count)
        self._wasted_groups = self._wasted_at_take = 0.0
        counted = (
            "dropped",
            "cancelled",
            "downweighted",
            "recomputed",
            "carried_over",
            "expired",
            "filtered",
            "filter_fill",
            "over_bound",
            "regenerated",
        )
        self.counters = dict.fromkeys(counted, 0)
        self._regenerations: dict[int, int] = {}  # prompt row index -> times regenerated (Regenerate)
        self._handed_regenerations: dict[int, int] = {}  # those of the batch handed out last

    def check_advantage(self, advantage: Any) -> None:
        self.bound.policy.check_advantage(advantage)
        check(
            "algo.advantage",
            type(advantage).__name__,
            not (advantage.per_response and self.group_filter is not None),
            "a group-wise estimator (algo/advantage=group) with rollout.group_filter (it judges "
            "complete groups; a running baseline releases responses one by one)",
        )

    def bind(self, ctx: RolloutContext) -> None:
        super().bind(ctx)
        self._units_per_group = self.group_size if ctx.advantage.per_response else 1
        self._sizing = Sizing.of(self, ctx.engine.concurrency)

    @property
    def _batch_units(self) -> int:
        return self.prompts_per_step * self._units_per_group

    # ------------------------------------------------------------------ producer side
    # Generation starts in the first next_batch, not here: bind runs in datamodule.setup,
    # before Lightning restores a checkpoint and before the first weight sync.

    def _outstanding(self) -> float:
        """Groups generating or ready (a group partly released by a running baseline: its share)."""
        if self._units_per_group == 1:
            return len(self._groups) + len(self._buffer)
        generating = sum(self.group_size - len(g.exps) for g in self._groups.values())
        return (generating + len(self._buffer)) / self.group_size

    def _resize(self) -> None:
        """A new bound (``StalenessBound.set_max_staleness``) resizes what may be outstanding
        (``P * (K + 1)`` of it is the bound's)."""
        if self.ctx is not None:
            old = self._sizing
            self._sizing = Sizing.of(self, self.ctx.engine.concurrency)
            self._sizing.adopt(old)

    def _target_inflight(self) -> int:
        return self._sizing.inflight

    def _top_up(self) -> None:
        """Start groups while below target, under buffer capacity and admission control."""
        if self._closed or self._error is not None:
            return
        while (
            len(self._groups) < self._target_inflight()
            and self._outstanding() < self._sizing.outstanding
            and self.bound.may_start(self._outstanding(), self.ctx.engine.version)
        ):
            self._start_group()

    def _start_group(self) -> None:
        row = self.ctx.prompts.next()
        gid = self.next_group_id
        self._groups[gid] = _Group(row, self.ctx.engine.version, self.ctx.engine.clock())
        self.started_groups += 1
        for fut, p in self.submit_group(row).items():
            self._track(fut, p)

    def _refuse(self) -> bool:
        """Refuse one more uninformative group, unless this batch's budget (as many groups as
        sync's ``max_rounds`` extra rounds may sample) is spent: then it is trained, counted
        in ``filter_fill``, so a task the policy has solved cannot starve the trainer."""
        assert self.group_filter is not None
        if self._refused_since_take < 4 * max(self.group_filter.max_rounds, 1) * self.prompts_per_step:
            self._refused_since_take += 1
            return True
        self.counters["filter_fill"] += 1
        return False

    def _replace_refused(self) -> None:
        """A group refused by ``rollout.group_filter``: the top-up that follows replaces it."""

    def _track(self, fut: cf.Future, p: Pending) -> None:
        self._requests[fut] = p
        self.ctx.engine.on_done(fut, self._on_done)  # scored off the engine's event loop

    def _on_done(self, fut: cf.Future) -> None:
        exp = None
        try:  # score outside the lock: a slow reward must not block the trainer's next_batch
            p = self._requests.get(fut)
            comp = fut.result() if p is not None and not self._closed else None
            if comp is not None and not self.is_unfinished(comp, p):
                exp = self.to_experience(comp, p)
        except BaseException as e:
            with self._cv:
                self._requests.pop(fut, None)
                if self._error is None:
                    self._error = e
                self._cv.notify_all()
            return
        with self._cv:
            try:
                p = self._requests.pop(fut, None)
                if p is None or self._closed:
                    return
                if exp is None:
                    # Aborted at a weight sync: continue from the partial response.
                    nxt = self.continuation(comp, p)
                    self.counters["carried_over"] += 1
                    self._track(self.submit(nxt), nxt)
                    return
                group = self._groups[p.group_id]
                group.exps.append(exp)
                if self.ctx.advantage.per_response:
                    self._release_single(p.group_id, group, exp)
                elif (
                    len(group.exps) == self.group_size and not self.informative(group.exps) and self._refuse()
                ):
                    del self._groups[p.group_id]  # dynamic sampling: refused, replaced
                    self._forget(group.row)
                    self.counters["filtered"] += 1
                    self._wasted_groups += 1
                    self.bias.on_issue(group.row.get("level"), -self.group_size)  # not trained
                    self._replace_refused()
                elif len(group.exps) == self.group_size:
                    del self._groups[p.group_id]
                    self._sizing.observe(self.ctx.engine.clock() - group.started_at)
                    exps = self.finish_group(group.exps)
                    exps[0].extras["row"] = group.row  # lets a checkpoint re-queue its prompt
                    oldest = min(e.oldest_version() for e in exps)
                    self._buffer.append(Ready(p.group_id, exps, oldest, time.time(), group.row.get("level")))
                self._top_up()
            except BaseException as e:  # surfaced by next_batch in the trainer thread
                if self._error is None:
                    self._error = e
            finally:
                self._cv.notify_all()

    def _release_single(self, gid: int, group: _Group, exp: Experience) -> None:
        exp.advantage = self.ctx.advantage.single(exp.reward, group.row.get("id"))
        exp.extras["row"] = group.row
        oldest = exp.oldest_version()
        self._buffer.append(Ready(gid, [exp], oldest, time.time(), group.row.get("level")))
        if len(group.exps) == self.group_size:
            del self._groups[gid]
            self._sizing.observe(self.ctx.engine.clock() - group.started_at)

    # ------------------------------------------------------------------ consumer side
    def next_batch(self) -> list[Experience]:
        engine = self.ctx.engine
        deadline = time.monotonic() + self.wait_timeout_s
        with self._cv:
            self._start_iteration()
            while True:
                if self._error is not None:
                    raise self._error
                batch = self._take()
                if batch is not None:
                    self._refused_since_take = 0
                    left = self.prompts_per_step + self._wasted_groups - self._wasted_at_take
                    self._sizing.after_take(left, engine.clock())  # what left generation, in groups
                    self._wasted_at_take = self._wasted_groups
                    self.stats["rollout/outstanding_target"] = float(self._sizing.outstanding)
                    self._top_up()
                    return batch
                self._top_up()
                engine.wait_on(self._cv)
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"no batch within rollout.wait_timeout_s={self.wait_timeout_s:g} s "
                        f"(buffer {len(self._buffer)} groups, {len(self._groups)} in flight)"
                    )

    def _start_iteration(self) -> None:
        """Hook for PartialRollout."""

    def _take(self) -> list[Experience] | None:
        version = self.ctx.engine.version
        # 1) What may no longer be trained leaves: expired, dropped (and cancelled while
        # generating, with cancel_doomed), or regenerated from its prompt (retirement.py).
        self._retire(version, time.time())
        if self.bound.policy.waits(self.bound, self, version):
            return None  # regenerate: a protected group due now is still generating
        # 2) Choose P groups by the selection rule (FIFO, stratified, admission).
        view = BatchView(
            buffer=self._buffer,
            generating=[(g.row.get("level"), g.start_version) for g in self._groups.values()],
            version=version,
            units=self._batch_units,
            issued_levels=self.bias.issued_levels,
            prompts_per_step=self.prompts_per_step,
            bound=self.bound,
        )
        chosen = self.selection.choose(view)
        if chosen is None:
            return None
        chosen = self.bound.policy.first(self.bound, self, chosen, version)  # regenerate: due groups
        with ctrl_c_held():  # a checkpoint on Ctrl-C sees the batch taken whole or not at all
            out = self._take_chosen(chosen, version)
        self.stats = {
            "rollout/buffer_size": float(len(self._buffer)),
            "rollout/inflight": float(len(self._groups)),
            "rollout/started_groups": float(self.started_groups),
            **{f"rollout/{k}": float(v) for k, v in self.counters.items()},
        }
        return out

    def _take_chosen(self, chosen: list[Ready], version: int) -> list[Experience]:
        """Take the chosen groups out of the buffer, weighted by the bound, and hand them out."""
        self.bound.record_take(version)
        out: list[Experience] = []
        for r in chosen:
            self._buffer.remove(r)
            past = self.bound.over_bound(version, r.start_version)
            r.exps = self.bound.admit(r.exps, version, r.start_version) or []  # 3) weight / recompute
            self.counters["over_bound"] += 1 if past and r.exps else 0
            for e in r.exps:
                e.staleness = version - e.oldest_version()
                if e.weight != 1.0:
                    self.counters["downweighted"] += 1
                if e.recompute:
                    self.counters["recomputed"] += 1
                out.append(e)
        rows = {r.group_id: r.exps[0].extras["row"] for r in chosen if r.exps and "row" in r.exps[0].extras}
        self.hand_out(rows, out, version)
        self._trained(list(rows.values()))
        if self.reweight:
            reweight_by_level(chosen, self._trained_levels, self.bias.issued_levels)
        return out

    # ------------------------------------------------------------------ lifecycle / state
    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        super().close()  # reward worker processes (outside the lock: stopping one can take ~1 s)
