"""LightningDataModule that streams training minibatches from the rollout engine.

``setup`` builds the vLLM engine (on its own cores / GPUs) and binds the rollout controller;
``train_dataloader`` is an endless stream: each rollout batch from the controller is split into
``minibatches`` x ``epochs`` optimizer steps, and the last one is flagged ``sync_after`` so the
``WeightSync`` callback pushes the new weights before the next rollout batch is requested.

The module pulls batches itself (``training_step(dataloader_iter)``): Lightning's default
fetcher would request batch k+1 before step k runs, i.e. sample it with stale weights.

    python train.py rollout=sync             # this datamodule is the default ``data``
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from contextlib import nullcontext as _nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from modules.checkpoint_rng import python_state, python_state_tuple
from modules.config_errors import check
from modules.engine import SamplingConfig, VLLMEngine
from modules.experience import Experience, collate
from modules.rollout.base import PromptStream, RolloutContext, RolloutController, wait_any


class RolloutDataModule(L.LightningDataModule):
    def __init__(
        self,
        task: Any,
        engine: VLLMEngine,
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
        admission = getattr(getattr(rollout, "staleness", None), "admission_control", False)
        check(
            "data.sync_every_s",
            sync_every_s,
            sync_every_s is None or not admission,
            "null with rollout.staleness=Admit (admission control counts batches per version)",
        )
        rollout.configure_rewards(reward_errors, reward_timeout_s)
        if reward_timeout_s is not None:
            from modules.rollout.rewards import pickle_task

            pickle_task(task)  # rewards then run in a worker process: fail before the engine starts
        self.sync_every = sync_every
        self.sync_every_s = sync_every_s
        rollout.batches_per_version = sync_every
        check("data.train_size", train_size, train_size >= 1, "an int >= 1")
        check("data.eval_size", eval_size, eval_size >= 0, "an int >= 0")
        self.task = task
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
        self.prompts: PromptStream | None = None
        self._pending_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------ lifecycle
    def setup(self, stage: str | None = None) -> None:
        if self.prompts is not None:
            return
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.engine.model_path)
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
            self.engine._pin_trainer()  # keep this rank off the engine cores too
            return
        self.engine.start()
        self.rollout.bind(
            RolloutContext(
                self.engine, self.task, self.tokenizer, self.prompts, self.advantage, seed=self.seed
            )
        )

    def teardown(self, stage: str | None = None) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        close = getattr(self.rollout, "close", None)
        if close is not None:
            close()
        self.engine.shutdown()

    # ------------------------------------------------------------------ training stream
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_RolloutStream(self), batch_size=None, num_workers=0)

    def _rollout_batches(self) -> Iterator[tuple[list[Experience], dict[str, float], bool]]:
        """Rank 0: (experiences, stats, sync due) for each rollout batch from the controller."""
        since_sync, last_sync = 0, time.monotonic()
        while True:
            t0 = time.perf_counter()
            exps = self.rollout.next_batch()
            waited = time.perf_counter() - t0
            self._audit(exps)
            self.rollout.bias.on_trained(exps)
            stats = {
                **rollout_stats(exps),
                **getattr(self.rollout, "stats", {}),
                **self.rollout.bias.metrics(),
                "rollout/reward_errors": float(self.rollout.reward_error_count),
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
            size = len(exps) // self.world_size
            payload = [(exps[r * size : (r + 1) * size], stats, due) for r in range(self.world_size)]
        out: list[Any] = [None]
        dist.scatter_object_list(out, payload, src=0)
        return out[0]

    def _batches(self) -> Iterator[dict[str, Any]]:
        rollouts = self._rollout_batches() if self.rank == 0 else None
        while True:
            exps, stats, due = self._share(next(rollouts) if rollouts is not None else None)
            self._audit_rank(exps)
            n = len(exps)
            batches = []
            for epoch in range(self.epochs):
                order = list(range(n))
                self.shuffle_rng.shuffle(order)
                chunks = [order[k :: self.minibatches] for k in range(self.minibatches)]
                for k, chunk in enumerate(chunks):
                    batch: dict[str, Any] = collate([exps[i] for i in chunk], self.tokenizer.pad_token_id)
                    batch["sync_after"] = due and epoch == self.epochs - 1 and k == self.minibatches - 1
                    batch["rollout_stats"] = stats if (epoch == 0 and k == 0) else {}
                    # samples this optimizer step consumed across all ranks (equal shards)
                    batch["num_samples"] = len(chunk) * self.world_size if epoch == 0 else 0
                    batches.append(batch)
            # Decoupled PPO needs pi_old: the trainer's logprobs before this update's first step.
            module = self.trainer.lightning_module if self.trainer is not None else None
            if getattr(module, "needs_old_logprobs", False):
                for batch in batches:
                    batch["old_logprobs"] = module.old_logprobs(batch)
            # Staleness policy `recompute`: the current policy (before this update) replaces the
            # behaviour logprobs of the flagged samples, once for all minibatches and epochs.
            if module is not None and any(bool(b["recompute"].any()) for b in batches):
                for batch in batches:
                    if batch["recompute"].any():
                        fresh = batch.get("old_logprobs")
                        fresh = module.old_logprobs(batch) if fresh is None else fresh
                        batch["behavior_logprobs"] = torch.where(
                            batch["recompute"][:, None], fresh, batch["behavior_logprobs"]
                        )
            yield from batches

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
        which prompts each policy version trained on (resume accounting, data audits)."""
        trainer = self.trainer
        if trainer is None or trainer.global_rank != 0:
            return
        ids = sorted({e.prompt_id for e in exps})
        line = {"version": self.engine.version, "step": trainer.global_step, "prompt_ids": ids}
        if self.world_size > 1:
            line["samples"] = [[e.group_id, e.sample_index] for e in exps]
        with open(Path(trainer.default_root_dir) / "trained_prompts.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    # ------------------------------------------------------------------ weights and eval
    def sync_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> float:
        """Push trainer weights to the engine as ``version``; returns seconds taken."""
        return self.engine.update_weights(
            named_tensors, version, inflight=getattr(self.rollout, "inflight", "keep")
        )

    def evaluate(self) -> dict[str, float]:
        """Held-out reward from the engine: greedy (``eval/reward_mean``, and per difficulty
        level) and sampled at the training temperature, ``eval_samples`` per prompt
        (``eval/sampled_reward_mean``: the quantity RL optimises, with less noise)."""
        if not self.eval_rows:
            return {}
        greedy = self._eval_pass(SamplingConfig(temperature=0.0, max_tokens=self.eval_max_tokens), 1)
        out = {"eval/reward_mean": greedy["mean"], "eval/response_len_mean": greedy["len"]}
        out.update({f"eval/reward_level{lv}": r for lv, r in greedy["levels"].items()})
        if self.eval_samples:
            temp = self.rollout.sampling.temperature
            sampled = self._eval_pass(
                SamplingConfig(temperature=temp, max_tokens=self.eval_max_tokens), self.eval_samples
            )
            out["eval/sampled_reward_mean"] = sampled["mean"]
            out.update({f"eval/sampled_reward_level{lv}": r for lv, r in sampled["levels"].items()})
        return out

    def _eval_pass(self, sampling: SamplingConfig, n: int) -> dict[str, Any]:
        futs = {}
        for i, row in enumerate(self.eval_rows):
            ids = self.tokenizer(self.task.prompt_text(row))["input_ids"]
            for k in range(n):
                fut = self.engine.submit(
                    ids, sampling, seed=1000 * i + k, request_id=f"eval-{time.time_ns()}-{i}-{k}"
                )
                futs[fut] = row
        rewards: dict[int, list[float]] = {}
        lengths = []
        pending = set(futs)
        while pending:
            done = wait_any(self.engine, pending)
            pending -= done
            for f in done:
                comp, row = f.result(), futs[f]
                text = self.tokenizer.decode(comp.token_ids, skip_special_tokens=True)
                rewards.setdefault(row.get("level", 0), []).append(
                    self.rollout.score(row, text)
                )  # timeout + error policy
                lengths.append(len(comp.token_ids))
        allr = [r for rs in rewards.values() for r in rs]
        return {
            "mean": sum(allr) / len(allr),
            "len": sum(lengths) / len(lengths),
            "levels": {lv: sum(rs) / len(rs) for lv, rs in sorted(rewards.items())},
        }

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        # Sync mode holds no buffered experience between steps: the prompt cursor is the state.
        lock = getattr(self.rollout, "_cv", None)
        with lock if lock is not None else _nullcontext():  # cursor and outstanding: one snapshot
            prompts = self.prompts.state_dict() if self.prompts else None
            outstanding = getattr(self.rollout, "outstanding_prompts", None)
            if prompts is not None and outstanding is not None and self.rollout.ctx is not None:
                prompts["front"] = outstanding() + prompts["front"]  # re-queued on resume
            return {
                "prompts": prompts,
                "rollout": self.rollout.state_dict(),
                "shuffle_rng": python_state(self.shuffle_rng.getstate()),
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
        if state.get("shuffle_rng") is not None:
            self.shuffle_rng.setstate(python_state_tuple(state["shuffle_rng"]))


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


def rollout_stats(exps: list[Experience]) -> dict[str, float]:
    """Per-rollout-batch statistics logged by the module."""
    n = len(exps)
    lengths = [len(e.response_ids) for e in exps]
    start = min(e.gen_start for e in exps)
    end = max(e.gen_end for e in exps)
    return {
        "train/reward_mean": sum(e.reward for e in exps) / n,
        "train/response_len_mean": sum(lengths) / n,
        "train/response_len_max": float(max(lengths)),
        "train/truncated_frac": sum(e.truncated for e in exps) / n,
        "rollout/gen_span_s": end - start,
        "rollout/tokens": float(sum(lengths)),
        # carried over: aborted and resubmitted, or generated across a weight update
        "rollout/carried_frac": sum(e.splits > 0 or len(e.version_spans) > 1 for e in exps) / n,
        # staleness histogram of this batch (share of samples 0, 1, 2, 3+ versions old)
        **{f"rollout/staleness_frac_{k}": sum(min(e.staleness, 3) == k for e in exps) / n for k in range(3)},
        "rollout/staleness_frac_3plus": sum(e.staleness >= 3 for e in exps) / n,
    }
