"""The rollout batch between the controller and the trainer, and what a checkpoint does with it.

A checkpoint can be written while the trainer holds a rollout batch: ``interrupted.ckpt`` in
``on_exception`` (SIGINT / SIGTERM mid-step), or a step-end checkpoint between two minibatches
of one rollout batch (``algo.minibatches`` > 1). The rule, exact in both cases: a batch is in
the checkpoint's weights once one of its optimizer steps has finished.

* None has (``in_training``), or the batch never reached training (the interrupt came between
  the controller's hand-out and the first step; the controller's half of the hand-out is
  atomic, ``ctrl_c_held``): the batch is given back. Its prompts are re-queued at the
  front of the prompt stream, the staleness bound's count of batches taken at its version
  forgets it (at K = 0 with ``throttle`` / ``admit`` that count left no slot to start a group,
  and the resumed run waited ``rollout.wait_timeout_s``), and the bias counts forget it.
  ``HandOff`` (a base of every controller) answers for it.
* Some have: the batch stays taken, and the datamodule saves the batch itself with how many
  of its steps are done (``InTraining``); the resumed run trains the remaining steps, the
  same minibatches (the shuffle's state before the batch travels with it).

So every prompt is trained exactly once across a kill and a resume. ``experiences.jsonl``
and ``trained_prompts.jsonl`` log a batch when it is drawn, with the ``step`` of its first
optimizer step: a checkpoint at ``global_step`` S holds exactly the logged batches of steps
< S (a killed run's later lines describe work the resumed run does again).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from data.rollout.bias import BiasTracker
from data.rollout.experience import Experience


@dataclass
class Handed:
    groups: dict[int, dict]  # group id -> prompt row of each group trained in the batch
    exps: list[Experience]
    version: int | None  # the version the staleness bound counted it at (None: no bound)


class HandOff:
    """What a controller handed out last (``hand_out``, at the end of ``next_batch``), and its
    state with that batch given back (``in_training=True``: the datamodule's call)."""

    _handed: Handed | None = None

    def hand_out(self, groups: dict[int, dict], exps: list[Experience], version: int | None = None) -> None:
        """The batch leaves the controller: counted as trained in the bias counts at once (a
        checkpoint that gives it back uncounts it), so the two never disagree."""
        self._handed = Handed(groups, exps, version)
        self.bias.on_trained(exps)

    def handed_batch(self) -> list[Experience] | None:
        """The batch handed out last (None before the first): the datamodule gives it back when
        an interrupt caught it before it reached training."""
        return None if self._handed is None else self._handed.exps

    def requeued_groups(self, in_training: bool = False) -> dict[int, dict]:
        """Group id -> row of every group whose prompt a checkpoint re-queues (oldest first):
        the batch in training when given back; streaming adds those generating or buffered."""
        handed = self._handed
        return dict(handed.groups) if in_training and handed is not None else {}

    def outstanding_prompts(self, in_training: bool = False) -> list[int]:
        """Row indexes of the prompts a checkpoint re-queues: their groups are not saved and
        are generated again on resume (with the checkpoint's weights), so each is trained once."""
        with self.lock:
            if self.ctx is None:
                return []
            return [self.ctx.prompts.index_of(row) for row in self.requeued_groups(in_training).values()]

    def _given_back(self, in_training: bool) -> Handed | None:
        return self._handed if in_training else None

    def _bias_state(self, in_training: bool) -> dict[str, Any]:
        """The bias counts without the batch given back (the datamodule counted it as trained
        when it drew it) and without the samples of re-queued groups (issued again on resume)."""
        counts = BiasTracker()
        counts.load_state_dict(self.bias.state_dict())
        handed = self._given_back(in_training)
        if handed is not None:
            counts.on_trained(handed.exps, sign=-1)
        for row in self.requeued_groups(in_training).values():
            counts.on_issue(row.get("level"), -self.group_size)
        return counts.state_dict()

    def _next_group_id(self, in_training: bool) -> int:
        """Group ids restart at the re-queued groups when they are the last ones planned, in
        order (sync: the batch given back, or the groups of an interrupted round)."""
        ids = list(self.requeued_groups(in_training))
        return ids[0] if ids and ids == list(range(ids[0], self.next_group_id)) else self.next_group_id

    def _taken_state(self, in_training: bool) -> dict[str, Any]:
        """The staleness bound's count of batches taken at a version, less the batch given back."""
        state = self.bound.state_dict()
        handed = self._given_back(in_training)
        at, count = state["taken"]
        if handed is not None and handed.version == at:
            state["taken"] = [at, max(count - 1, 0)]
        return state


@dataclass
class InTraining:
    """The rollout batch the trainer is stepping through (datamodule side)."""

    exps: list[Experience] | None  # the whole batch (rank 0; every rank after a resume)
    due: bool  # a weight sync follows its last step
    rng: tuple  # the minibatch shuffle's state before the batch
    first_step: int  # trainer.global_step at its first optimizer step
    n_steps: int

    def done(self, trainer: Any) -> int:
        """Its optimizer steps finished by now (0 without a trainer)."""
        step = getattr(trainer, "global_step", None)
        return 0 if step is None else min(max(int(step) - self.first_step, 0), self.n_steps)

    def state(self, done: int, rng_state: list) -> dict[str, Any] | None:
        """What a checkpoint keeps of it: the batch, when some but not all of its steps are done."""
        if self.exps is None or not 0 < done < self.n_steps:
            return None
        return {"exps": [exp_state(e) for e in self.exps], "due": self.due, "rng": rng_state, "done": done}


def exp_state(e: Experience) -> dict[str, Any]:
    """An experience as plain values (checkpoints load with ``weights_only``); the prompt row
    is left out: a saved batch is never re-queued."""
    state = asdict(e)
    state["extras"] = {k: v for k, v in e.extras.items() if k != "row"}
    state["version_spans"] = [list(s) for s in e.version_spans]
    return state


def exp_from_state(state: dict[str, Any]) -> Experience:
    return Experience(**{**state, "version_spans": [tuple(s) for s in state["version_spans"]]})


def shard(exps: list[Experience], rank: int, world_size: int) -> list[Experience]:
    """Rank ``rank``'s contiguous equal share of a rollout batch (DDP)."""
    size = len(exps) // world_size
    return exps[rank * size : (rank + 1) * size]
