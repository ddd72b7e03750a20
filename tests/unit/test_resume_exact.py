"""Resume from a checkpoint written at any point of a step trains every prompt exactly once
and never waits for generation that cannot start (issue 36, item 1; virtual-clock engine).

The simulator analogue of ``tests/e2e/test_resume.py::test_kill_9_and_resume_*``: a fake trainer
steps through the datamodule's optimizer steps (``RolloutDataModule._batches``, as
``training_step(dataloader_iter)`` does), syncs the engine after each rollout batch's last
step and writes a "checkpoint" (``global_step``, the served version, the datamodule's state
through ``torch.save`` with ``weights_only`` loading) at one of these points:

* ``between``: at a step end after a rollout batch's last minibatch and its weight sync
  (``ModelCheckpoint``; also the one a SIGKILL resumes from);
* ``taken``: a rollout batch was handed to the trainer, none of its optimizer steps done
  (``interrupted.ckpt``, written in ``on_exception`` by a SIGINT / SIGTERM mid-step);
* ``drawn``: the controller handed a batch out (logged, counted as taken) and the interrupt
  came before the datamodule put it in training (a Ctrl-C during its collation);
* ``mid``: with two minibatches, after the first one's optimizer step (a step-end checkpoint,
  or an interrupt during the second step).

A fresh engine, controller and datamodule resume from it. Counted from ``experiences.jsonl``
(the killed run's lines of steps before the checkpoint's ``global_step``, then the resumed
run's) and from the samples of the optimizer steps that ran: no prompt trained twice, no
prompt lost, no wait.
"""

from __future__ import annotations

import io
import json
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from data.rollout.controller import RolloutContext
from data.rollout.datamodule import RolloutDataModule
from data.rollout.partial import PartialRollout
from data.rollout.prompts import PromptStream
from data.rollout.staleness import Admit, Drop, Throttle
from data.rollout.streaming import StreamingRollout
from data.rollout.sync import SyncRollout
from modules.algo.advantages import GroupAdvantage
from modules.engine import SamplingConfig
from modules.engine.sim import CharTokenizer, SimEngine, SimTask

SAMPLING = SamplingConfig(max_tokens=1000)
P, G = 2, 2
LENGTHS = [3, 17, 5, 40, 8, 12, 60, 4, 9, 25, 6, 30] * 30  # 360 prompts: one epoch is plenty
WAIT_S = 5.0  # a resume that cannot start generation fails in seconds, not 600 s
POLICIES = {"drop": Drop, "throttle": Throttle, "admit": Admit}


class Recording(PromptStream):
    """The prompt stream, recording the row id of every prompt it serves."""

    def __init__(self, rows: list[dict]) -> None:
        super().__init__(rows, seed=0)
        self.served: list[int] = []

    def next(self) -> dict:
        row = super().next()
        self.served.append(row["id"])
        return row


def controller(mode: str, policy: str | None, k: int | None):
    if mode == "sync":
        return SyncRollout(P, G, SAMPLING)
    staleness = POLICIES[policy]()
    if mode == "partial":
        return PartialRollout(
            P, G, SAMPLING, 2.0, max_staleness=k, staleness=staleness, wait_timeout_s=WAIT_S
        )
    return StreamingRollout(
        P, G, SAMPLING, 6, k, staleness, buffer_capacity=8, wait_timeout_s=WAIT_S, cancel_doomed=True
    )


class Run:
    """One training process: engine, controller, datamodule and a fake trainer (rank 0)."""

    def __init__(
        self, run_dir: Path, mode: str, policy: str | None, k: int | None, mb: int, sync_every: int = 1
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.dir = run_dir
        self.eng = SimEngine()
        self.ctl = controller(mode, policy, k)
        task = SimTask(LENGTHS)
        self.dm = RolloutDataModule(
            task, self.eng, self.ctl, GroupAdvantage(), minibatches=mb, eval_size=0, sync_every=sync_every
        )
        # what setup() does, without a tokenizer download
        self.dm.tokenizer, self.dm.train_rows = CharTokenizer(), task.rows
        self.dm.prompts = self.prompts = Recording(task.rows)
        self.ctl.bind(RolloutContext(self.eng, task, CharTokenizer(), self.prompts, self.dm.advantage))
        self.trainer = SimpleNamespace(
            global_step=0, global_rank=0, world_size=1, default_root_dir=str(run_dir)
        )
        self.dm.trainer = self.trainer
        self.trained: list[list[tuple[int, int]]] = []  # (group id, sample index) per optimizer step
        self._stream = None
        self.armed: str | bool = False  # the point a Ctrl-C comes at: "waiting" (for generation), "drawn"
        self.fired = False
        for name in ("wait_any", "wait_on"):
            setattr(self.eng, name, self._interruptible(getattr(self.eng, name)))
        self.dm._share = self._interruptible(self.dm._share, "drawn")

    def _interruptible(self, wait, point: str = "waiting"):
        def waiting(*args):
            if self.armed == point:
                self.armed, self.fired = False, True
                raise KeyboardInterrupt
            return wait(*args)

        return waiting

    def resume(self, ckpt: dict) -> None:
        """What Lightning and WeightSync.on_train_start do with a checkpoint."""
        self.trainer.global_step = ckpt["global_step"]
        state = torch.load(io.BytesIO(ckpt["datamodule"]), weights_only=True)
        self.dm.load_state_dict(state)
        self.eng.update_weights({}, ckpt["version"])
        self.dm.set_trainer_version(ckpt["version"])

    def checkpoint(self) -> dict:
        buf = io.BytesIO()
        torch.save(self.dm.state_dict(), buf)
        return {
            "global_step": self.trainer.global_step,
            "version": self.eng.version,
            "datamodule": buf.getvalue(),
        }

    def draw(self) -> list[dict]:
        """training_step's ``next(dataloader_iter)``: the rollout batch's optimizer steps."""
        if self._stream is None:
            self._stream = self.dm._batches()
        t0 = time.monotonic()
        steps = next(self._stream)
        assert time.monotonic() - t0 < WAIT_S, "waited for a batch"
        return steps

    def step(self, batch: dict) -> None:
        """One optimizer step (virtual time passes), then the weight sync when it is due."""
        self.trained.append(list(zip(batch["group_ids"].tolist(), batch["sample_indexes"].tolist())))
        self.eng.advance_to(self.eng.now + 4.0)
        self.trainer.global_step += 1
        if batch["sync_after"]:
            self.eng.update_weights({}, self.eng.version + 1, inflight=self.ctl.inflight)
            self.dm.set_trainer_version(self.eng.version)

    def train(self, n_steps: int, stop: tuple[int, str] | None = None) -> dict | None:
        """Train until global_step reaches n_steps (whole rollout batches), or write a checkpoint
        at ``stop`` = (rollout batch index, point) and return it (the process then dies)."""
        b = 0
        while self.trainer.global_step < n_steps:
            arm = stop is not None and stop[1] in ("waiting", "drawn") and b >= stop[0]
            self.armed = stop[1] if arm else False
            try:
                steps = self.draw()
            except KeyboardInterrupt:  # Lightning's on_exception writes interrupted.ckpt
                return self.checkpoint()
            self.armed = False
            if stop == (b, "taken"):
                return self.checkpoint()
            for i, batch in enumerate(steps):
                self.step(batch)
                if stop == (b, "mid") and i == 0:
                    return self.checkpoint()
            if stop == (b, "between"):
                return self.checkpoint()
            b += 1
        return None

    def lines(self) -> list[dict]:
        path = self.dir / "experiences.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_checkpoint_written_mid_step_at_k0_resumes_at_once_and_trains_the_batch(tmp_path):
    """Throttle at K = 0: the batch in training at the interrupt is re-queued and the bound's
    count of batches taken at its version forgets it, so the resumed run starts generating
    (it waited wait_timeout_s: taken [v, 1] left (K + 1) * 1 - 1 = 0 free slots)."""
    for policy in ("throttle", "admit"):
        first = Run(tmp_path / policy / "first", "streaming", policy, 0, 1)
        first.train(4)
        ckpt = first.train(8, stop=(0, "taken"))  # the next batch drawn, then Ctrl-C
        handed = {x["prompt_id"] for x in first.lines() if x["step"] == ckpt["global_step"]}
        assert len(handed) == P
        second = Run(tmp_path / policy / "second", "streaming", policy, 0, 1)
        second.resume(ckpt)
        second.train(ckpt["global_step"] + 1)  # the resumed run's first batch: no wait
        assert {x["prompt_id"] for x in second.lines()} == handed
        state = torch.load(io.BytesIO(ckpt["datamodule"]), weights_only=True)
        assert state["rollout"]["taken"] == [ckpt["version"], 0]
        assert set(state["prompts"]["front"][:P]) == handed  # row index = row id here


@pytest.mark.parametrize("policy", ["throttle", "admit"])
def test_controller_state_with_its_batch_in_training_leaves_room_at_k0(policy):
    """The controller alone: its state with the batch it handed out still in training."""
    eng = SimEngine()
    task = SimTask(LENGTHS)

    def bound(ctl, engine):
        ctl.bind(RolloutContext(engine, task, CharTokenizer(), PromptStream(task.rows), GroupAdvantage()))
        return ctl

    ctl = bound(controller("streaming", policy, 0), eng)
    batch = ctl.next_batch()
    front = ctl.outstanding_prompts(in_training=True)
    state = ctl.state_dict(in_training=True)
    assert ctl.state_dict()["taken"] == [0, 1]  # trained: the version's batch is taken
    fresh = bound(controller("streaming", policy, 0), SimEngine())
    fresh.load_state_dict(state)
    assert fresh.bias.trained_levels == Counter()  # given back: not counted as trained
    fresh.ctx.prompts.load_state_dict({**ctl.ctx.prompts.state_dict(), "front": front})
    assert sorted(e.prompt_id for e in fresh.next_batch()) == sorted(e.prompt_id for e in batch)
    assert fresh.bias.trained_levels == Counter(e.difficulty for e in batch)  # once, handed out again


def matrix() -> list[tuple]:
    cases = [("sync", None, None)]
    cases += [(m, p, k) for m in ("partial", "streaming") for p in POLICIES for k in (0, 1, 2)]
    return cases


@pytest.mark.parametrize("mode, policy, k", matrix())
@pytest.mark.parametrize(
    "point, mb",
    [("between", 1), ("waiting", 1), ("taken", 1), ("taken", 2), ("mid", 2), ("drawn", 1), ("drawn", 2)],
)
def test_resume_at_any_point_of_a_step_loses_and_repeats_nothing(tmp_path, mode, policy, k, point, mb):
    first = Run(tmp_path / "first", mode, policy, k, mb)
    at = 2
    ckpt = first.train(12 * mb, stop=(at, point))
    assert ckpt is not None
    s = ckpt["global_step"]
    if point == "waiting":  # the first draw from batch `at` on that waits for generation
        assert first.fired and s >= at * mb and s % mb == 0
    else:
        assert s == {"between": (at + 1) * mb, "taken": at * mb, "mid": at * mb + 1, "drawn": at * mb}[point]
        assert first.fired == (point == "drawn")
    check_resume(tmp_path, first, ckpt, mode, policy, k, mb)


@pytest.mark.parametrize("policy", ["throttle", "admit"])
@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("at, point", [(2, "taken"), (3, "taken"), (2, "between"), (3, "between")])
def test_resume_mid_version_with_two_batches_per_sync(tmp_path, policy, k, at, point):
    """data.sync_every=2: the version's first or second batch in training at the checkpoint."""
    first = Run(tmp_path / "first", "streaming", policy, k, 1, sync_every=2)
    ckpt = first.train(12, stop=(at, point))
    state = torch.load(io.BytesIO(ckpt["datamodule"]), weights_only=True)
    taken_at, taken = state["rollout"]["taken"]
    # batches of the served version in the checkpoint's weights: the one in training is not
    assert (taken if taken_at == ckpt["version"] else 0) == (at + (point == "between")) % 2
    check_resume(tmp_path, first, ckpt, "streaming", policy, k, 1, sync_every=2)


def check_resume(tmp_path, first, ckpt, mode, policy, k, mb, sync_every=1):
    """Resume ``first``'s checkpoint in a fresh process and account for every prompt."""
    s = ckpt["global_step"]
    served = list(first.prompts.served)
    state = torch.load(io.BytesIO(ckpt["datamodule"]), weights_only=True)
    front = state["prompts"]["front"]
    before = [x for x in first.lines() if x["step"] < s]  # in the checkpoint's weights
    assert len({x["step"] for x in before}) == -(-s // mb)  # whole rollout batches, by first step

    second = Run(tmp_path / "second", mode, policy, k, mb, sync_every)
    second.resume(ckpt)
    second.train(s + mb * (len(front) // P + 4))
    after = second.lines()

    # experiences.jsonl: every trained prompt's G samples once, in one of the two runs
    per_prompt = Counter(x["prompt_id"] for x in before + after)
    assert set(per_prompt.values()) == {G}, {p: n for p, n in per_prompt.items() if n != G}
    # the optimizer steps that ran (the killed run's up to the checkpoint): the same samples
    run1 = {(x["group"], x["sample"]): x["prompt_id"] for x in before}
    run2 = {(x["group"], x["sample"]): x["prompt_id"] for x in after}
    assert len(first.trained) == s  # the killed run stepped exactly what the checkpoint holds
    ran = Counter(run1[key] for step in first.trained for key in step)
    ran += Counter(run2[key] if key in run2 else run1[key] for step in second.trained for key in step)
    assert ran == per_prompt
    # nothing lost: each prompt served before the checkpoint was trained before it, is
    # re-queued in it, or was dropped by the policy (counted in rollout/dropped)
    trained1 = {x["prompt_id"] for x in before}
    missing = set(served) - trained1 - set(front)
    assert len(missing) == state["rollout"].get("counters", {}).get("dropped", 0)
    assert not trained1 & set(front)
    # the re-queued ones are trained by the resumed run (or dropped there, by that policy)
    dropped = second.ctl.counters["dropped"] - state["rollout"]["counters"]["dropped"] if policy else 0
    assert len(set(front) - {x["prompt_id"] for x in after}) <= dropped

    if mode == "sync":  # the barrier is deterministic: exactly the uninterrupted run's batches
        whole = Run(tmp_path / "whole", mode, policy, k, mb, sync_every)
        whole.train(second.trainer.global_step)
        assert [(x["prompt_id"], x["group"]) for x in whole.lines()] == [
            (x["prompt_id"], x["group"]) for x in before + after
        ]
