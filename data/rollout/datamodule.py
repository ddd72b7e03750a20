"""LightningDataModule that streams rollout batches from the engine to the trainer.

``setup`` starts the engine (on its own cores / GPUs) and binds the rollout controller;
``train_dataloader`` is an endless stream with one item per rollout batch: the list of its
``minibatches`` x ``epochs`` optimizer steps (``batches.py``), the last one flagged
``sync_after`` so the ``WeightSync`` callback pushes the new weights before the next rollout
batch is requested. The module pulls these items itself (``training_step(dataloader_iter)``):
Lightning's default fetcher would request the next rollout batch before the current step
runs, i.e. sample it with weights that are about to change. Under DDP rank 0 owns the engine
and scatters equal shards of each rollout batch (``_share``). The data path reads one way:
task -> engine -> controller -> this datamodule -> module (the module computes pi_old itself).

    python train.py rollout=sync             # this datamodule is the default ``data``
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from data.envs.episodes import EpisodeRunner
from data.rollout.batches import minibatches, rollout_stats
from data.rollout.controller import RolloutContext, RolloutController
from data.rollout.evaluation import HeldOutEvaluator
from data.rollout.experience import Experience, experience_line
from data.rollout.handoff import InTraining, exp_from_state, shard
from data.rollout.prompt_fit import check_prompts
from data.rollout.prompts import PromptStream
from data.rollout.rewards import pickle_task
from modules.config.errors import check
from modules.engine.types import Engine
from modules.policy.checkpoint_rng import python_state, python_state_tuple
from modules.policy.prompt_format import PlainText


class RolloutDataModule(L.LightningDataModule):
    def __init__(
        self,
        task: Any,
        engine: Engine,
        rollout: RolloutController,
        advantage: Any,
        minibatches: int = 1,
        epochs: int = 1,
        train_size: int = 50000,
        eval_size: int = 256,
        eval_max_tokens: int | None = None,
        eval_samples: int = 4,
        seed: int = 0,
        sync_every: int = 1,
        sync_every_s: float | None = None,
        reward_errors: str = "fail",
        reward_timeout_s: float | None = None,
        env: Any = None,
        prompt_format: Any = None,
    ) -> None:
        super().__init__()
        check(
            "algo.minibatches", minibatches, isinstance(minibatches, int) and minibatches >= 1, "an int >= 1"
        )
        check("algo.epochs", epochs, isinstance(epochs, int) and epochs >= 1, "an int >= 1")
        n_samples = rollout.prompts_per_step * rollout.group_size
        check(
            "algo.minibatches",
            minibatches,
            minibatches <= n_samples,
            f"<= rollout.prompts_per_step * rollout.group_size = {n_samples}",
        )
        check(
            "data.sync_every",
            sync_every,
            isinstance(sync_every, int) and sync_every >= 1,
            "an int >= 1 (rollout batches per weight sync)",
        )
        check(
            "data.sync_every_s", sync_every_s, sync_every_s is None or sync_every_s > 0, "null or a float > 0"
        )
        if rollout.bound is not None:
            rollout.bound.check_sync_every_s(sync_every_s)
        rollout.check_advantage(advantage)
        rollout.configure_rewards(reward_errors, reward_timeout_s)
        if reward_timeout_s is not None:
            pickle_task(task)  # rewards then run in a worker process: fail before the engine starts
        self.sync_every = sync_every
        self.sync_every_s = sync_every_s
        rollout.batches_per_version = sync_every
        check("data.train_size", train_size, train_size >= 1, "an int >= 1")
        check("data.eval_size", eval_size, eval_size >= 0, "an int >= 0")
        self.task = task
        self.prompt_format = prompt_format or PlainText()  # model.prompt_format: text -> prompt ids
        self.env = env  # data.envs.base.Environment: multi-turn episodes (None: one turn per prompt)
        self.episodes: EpisodeRunner | None = None
        self.engine = engine
        self.rollout = rollout
        self.advantage = advantage
        self.minibatches = minibatches
        self.epochs = epochs
        self.train_size = train_size
        self.eval_size = eval_size
        self.eval_max_tokens = eval_max_tokens or rollout.sampling.max_tokens
        check("data.eval_samples", eval_samples, eval_samples >= 0, "an int >= 0 (0 = greedy only)")
        self.eval_samples = eval_samples
        self.seed = seed
        self.shuffle_rng = random.Random(seed)  # minibatch order; checkpointed
        self.world_size, self.rank = 1, 0  # DDP ranks, set in setup()
        self.tokenizer: Any = None
        self.train_rows: list[dict] | None = None
        self.prompts: PromptStream | None = None
        self.evaluator: HeldOutEvaluator | None = None
        self._pending_state: dict[str, Any] | None = None
        self._in_training: InTraining | None = None  # the rollout batch the trainer holds
        self._rng_at_draw = self.shuffle_rng.getstate()  # the shuffle's state before the last draw
        self._resumed: dict[str, Any] | None = None  # one a checkpoint saved part-way through

    def preflight(self, max_model_len: int | None) -> None:
        """Start-up checks with the tokenizer and the task's rows, before the engine or a model
        is built (``modules/launch/start.py``; the prompts against the context: ``prompt_fit.py``)."""
        if not Path(self.engine.model_path, "config.json").exists():
            return  # no model yet, or a hub id (preflight's own check names the path)
        self._load_tokenizer()
        self.train_rows = list(self.task.build("train", self.train_size))
        check_prompts(self, max_model_len)

    def _load_tokenizer(self) -> None:
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.engine.model_path)

    def setup(self, stage: str | None = None) -> None:
        if self.prompts is not None:
            return
        self._load_tokenizer()
        self.prompt_format.check(self.tokenizer, self.engine.model_path)  # a hub model: first here
        if self.train_rows is None:
            self.train_rows = list(self.task.build("train", self.train_size))
        self.eval_rows = list(self.task.build("eval", self.eval_size)) if self.eval_size else []
        self.prompts = PromptStream(self.train_rows, seed=self.seed)
        if self._pending_state is not None:
            self._restore(self._pending_state)
        self.world_size, self.rank = _world(self.trainer)
        n = self.rollout.prompts_per_step * self.rollout.group_size
        check(
            "trainer.devices",
            self.world_size,
            n % (self.world_size * self.minibatches) == 0,
            f"a number of ranks that, times algo.minibatches={self.minibatches}, divides the "
            f"rollout batch rollout.prompts_per_step * rollout.group_size = {n} (every rank "
            "takes the same number of optimizer steps on an equal shard)",
        )
        if self.rank != 0:
            # DDP: only rank 0 owns the engine and the rollout controller; this rank receives
            # its shard of every rollout batch from rank 0 (see `_share`).
            self.engine.pinning.apply()  # keep this rank off the engine cores too
            return
        self.engine.start()
        if self.env is not None:
            args = (self.engine, self.env, self.tokenizer, self.rollout.reward_errors, self.prompt_format)
            self.episodes = EpisodeRunner(*args)
        self.rollout.bind(
            RolloutContext(
                self.engine,
                self.task,
                self.tokenizer,
                self.prompts,
                self.advantage,
                seed=self.seed,
                episodes=self.episodes,
                prompt_format=self.prompt_format,
            )
        )
        self.evaluator = HeldOutEvaluator(
            self.engine,
            self.task,
            self.tokenizer,
            self.eval_rows,
            self.rollout.score,  # the reward timeout and error policy apply to evaluation too
            self.rollout.sampling.temperature,
            self.eval_max_tokens,
            self.eval_samples,
            episodes=self.episodes,
            prompt_format=self.prompt_format,
        )

    def teardown(self, stage: str | None = None) -> None:
        """Stop the engine and the reward workers; safe to call twice (train.py's guard calls
        it again after a failed fit)."""
        self.rollout.close()
        if self.episodes is not None:
            self.episodes.close()
        self.engine.shutdown()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_RolloutStream(self), batch_size=None, num_workers=0, collate_fn=_as_is)

    def _rollout_batches(self) -> Iterator[tuple[list[Experience], dict[str, float], bool]]:
        """Rank 0: (experiences, stats, sync due) for each rollout batch from the controller."""
        since_sync, last_sync = self.rollout.batches_taken_this_version(), time.monotonic()
        while True:
            t0 = time.perf_counter()
            exps = self.rollout.next_batch()
            waited = time.perf_counter() - t0
            self._audit(exps)
            stats = {
                **rollout_stats(exps),
                **self.rollout.stats,
                **self.rollout.bias.metrics(),
                "rollout/reward_errors": float(self.rollout.reward_error_count),
                **(self.episodes.take_stats("train") if self.episodes is not None else {}),
            }
            stats["perf/rollout_wait_s"] = waited
            # Weight sync trigger: every `sync_every` rollout batches, or once `sync_every_s`
            # seconds have passed since the last sync (checked at rollout-batch boundaries).
            since_sync += 1
            due = since_sync >= self.sync_every or (
                self.sync_every_s is not None and time.monotonic() - last_sync >= self.sync_every_s
            )
            if due:
                since_sync, last_sync = 0, time.monotonic()
            yield exps, stats, due

    def _share(
        self, item: tuple[list[Experience], dict[str, float], bool] | None
    ) -> tuple[list[Experience], dict[str, float], bool]:
        """DDP: rank 0 splits the rollout batch into equal contiguous shards (whole groups
        when the group count allows) and scatters them; every rank returns its own shard.
        The sync decision and the batch statistics travel with the shard, so all ranks take
        the same steps and log the same rollout metrics. One rank: the batch as it is."""
        if self.world_size == 1:
            assert item is not None
            return item
        import torch.distributed as dist

        payload = None
        if self.rank == 0:
            assert item is not None
            exps, stats, due = item
            payload = [(shard(exps, r, self.world_size), stats, due) for r in range(self.world_size)]
        out: list[Any] = [None]
        dist.scatter_object_list(out, payload, src=0)
        return out[0]

    def _batches(self) -> Iterator[list[dict[str, Any]]]:
        """This rank's optimizer steps, one list per rollout batch. After a resume from a
        checkpoint written part-way through a rollout batch, first that batch's remaining
        steps (``handoff.py``): the same minibatches, from the shuffle's state before it."""
        rollouts = self._rollout_batches() if self.rank == 0 else None
        while True:
            resumed, self._resumed = self._resumed, None
            if resumed is not None:
                full, stats, due = [exp_from_state(e) for e in resumed["exps"]], {}, resumed["due"]
                done = int(resumed["done"])
                self.shuffle_rng.setstate(python_state_tuple(resumed["rng"]))
                exps = shard(full, self.rank, self.world_size)
            else:
                self._rng_at_draw = self.shuffle_rng.getstate()  # a batch given back restores it
                item = next(rollouts) if rollouts is not None else None
                full, done = (item[0] if item is not None else None), 0
                exps, stats, due = self._share(item)
                self._audit_rank(exps)
            rng = self.shuffle_rng.getstate()
            pad_id = self.tokenizer.pad_token_id
            args = (self.minibatches, self.epochs, self.shuffle_rng, pad_id, stats, due, self.world_size)
            steps = minibatches(exps, *args)
            first = int(getattr(self.trainer, "global_step", 0) or 0) - done
            self._in_training = InTraining(full, bool(due), rng, first, len(steps))
            yield steps[done:]

    def _audit_rank(self, exps: list[Experience]) -> None:
        """DDP only: each rank appends the samples it trains on to
        ``trained_samples.rank<r>.jsonl`` (shards must be disjoint and cover the batch)."""
        trainer = self.trainer
        if self.world_size == 1 or trainer is None:
            return
        line = {"step": trainer.global_step, "samples": [[e.group_id, e.sample_index] for e in exps]}
        with open(Path(trainer.default_root_dir) / f"trained_samples.rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def _audit(self, exps: list[Experience]) -> None:
        """Append the trained prompt ids to ``trained_prompts.jsonl`` in the run directory:
        which prompts each policy version trained on (resume accounting, data audits); and one
        line per trained sample to ``experiences.jsonl`` (for offline analysis: lengths,
        generation times, staleness, versions, rewards)."""
        trainer = self.trainer
        if trainer is None or trainer.global_rank != 0:
            return
        version = self.rollout.trainer_version
        version = self.engine.version if version is None else version
        ids = sorted({e.prompt_id for e in exps})
        line = {"version": version, "step": trainer.global_step, "prompt_ids": ids}
        if self.world_size > 1:
            line["samples"] = [[e.group_id, e.sample_index] for e in exps]
        run_dir = Path(trainer.default_root_dir)
        with open(run_dir / "trained_prompts.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        with open(run_dir / "experiences.jsonl", "a") as f:
            for e in exps:
                f.write(json.dumps(experience_line(e, trainer.global_step, version)) + "\n")

    def sync_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> float:
        """Push trainer weights to the engine as ``version``; returns seconds taken."""
        return self.engine.update_weights(named_tensors, version, inflight=self.rollout.inflight)

    def set_trainer_version(self, version: int) -> None:
        """The trainer's policy version (ahead of the engine's under a delayed sync): the sync
        rollout counts its samples' staleness from it."""
        self.rollout.trainer_version = version

    def staleness_bound(self) -> float | None:
        """The rollout's ``max_staleness``, moved by ``modules.callbacks.drift_controller``: None in
        sync mode (nothing is stale), ``inf`` for an unbounded one (partial rollout's default)."""
        if self.rollout.bound is None:
            return None
        k = self.rollout.max_staleness
        return math.inf if k is None else k

    def set_staleness_bound(self, value: int | None) -> None:
        if self.rollout.bound is not None:  # sync: nothing is stale, no bound to move
            with self.rollout.lock:
                self.rollout.bound.set_max_staleness(value)

    def engine_stats(self) -> dict[str, float]:
        """Engine-side metrics since it started ({} where this rank has no engine)."""
        return self.engine.stats()

    def engine_logprobs(self, sequence: list[int]) -> list[float]:
        """The engine's logprob (temperature 1) of each token of ``sequence`` after the first."""
        return self.engine.score(sequence)

    def evaluate(self) -> dict[str, float]:
        """Held-out reward from the engine (``evaluation.py``); {} without eval prompts."""
        return self.evaluator.evaluate() if self.evaluator is not None else {}

    def state_dict(self) -> dict[str, Any]:
        # Prompts of groups still generating or buffered are re-queued on resume (their partial
        # generations are not saved). Cursor and outstanding: one snapshot. The rollout batch in
        # training (``handoff.py``) is given back while none of its optimizer steps is done (or
        # it was ``drawn`` but never reached training), else kept here with its steps done.
        with self.rollout.lock:
            batch, handed = self._in_training, self.rollout.handed_batch()
            drawn = handed is not None and (batch is None or batch.exps is not handed)
            done = 0 if drawn else batch.done(self.trainer) if batch is not None else -1
            given_back = done == 0
            before = self._rng_at_draw if drawn else batch.rng if given_back else self.shuffle_rng.getstate()
            rng = python_state(before)
            prompts = self.prompts.state_dict() if self.prompts else None
            if prompts is not None and self.rollout.ctx is not None:
                prompts["front"] = self.rollout.outstanding_prompts(given_back) + prompts["front"]
            return {
                "prompts": prompts,
                "rollout": self.rollout.state_dict(given_back),
                "advantage": self.advantage.state_dict(),  # e.g. running baselines
                "shuffle_rng": rng,
                "in_training": batch.state(done, python_state(batch.rng)) if batch and not drawn else None,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.prompts is None:
            self._pending_state = state  # applied in setup()
        else:
            self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        if state.get("prompts") and self.prompts is not None:
            self.prompts.load_state_dict(state["prompts"])
        self.rollout.load_state_dict(state["rollout"])
        self.advantage.load_state_dict(state.get("advantage", {}))
        if state.get("shuffle_rng") is not None:
            self.shuffle_rng.setstate(python_state_tuple(state["shuffle_rng"]))
        self._resumed = state.get("in_training")


class _RolloutStream(IterableDataset):
    def __init__(self, dm: RolloutDataModule) -> None:
        self.dm = dm

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.dm._batches()


def _world(trainer: Any) -> tuple[int, int]:
    """(world size, global rank) of the Lightning trainer; (1, 0) without one."""
    if trainer is None:
        return 1, 0
    return int(trainer.world_size), int(trainer.global_rank)


def _as_is(item: Any) -> Any:
    """The DataLoader's collate: items are already collated minibatches."""
    return item
