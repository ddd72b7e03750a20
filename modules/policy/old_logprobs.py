"""pi_old of a rollout batch: which rows need it, one scoring pass per sample, and the copy a
checkpoint keeps when it is written part-way through the batch.

A mixin of ``PolicyGradientModule`` (``modules/policy/policy_gradient.py``), which provides
``needs_old_logprobs``, ``old_logprobs(batch)`` (the current weights' logprobs), ``kl_reward``,
``ref_logprobs``, ``global_step``, ``device`` and ``_steps`` (the optimizer steps left of the
batch in training).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch


class OldLogprobs:
    def init_old_logprobs(self) -> None:
        # pi_old of this rollout batch's samples by (group_id, sample_index): one pass per sample
        self._old_by_sample: dict[tuple[int, int], torch.Tensor] = {}
        self._old_tokens: dict[tuple[int, int], int] = {}  # their tokens' digest (token_digest)
        self._batch_first_step = 0  # global_step at the current rollout batch's first update
        # pi_old saved by a checkpoint written part-way through a rollout batch
        # (``part_trained_old``); the resumed run's first batch, that batch's remaining
        # minibatches, takes it instead of scoring with its partly updated weights
        self._resumed_old: dict[tuple[int, int], tuple[int, torch.Tensor]] | None = None

    def prepare_rollout_batch(self, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The passes a rollout batch needs before its first update, with the current weights:
        pi_old for a decoupled anchor; in bypass mode, pi_old of the samples the ``Recompute``
        staleness policy flagged (their ratio restarts at the current policy; the other rows
        keep pi_old := mu). The behaviour logprobs mu are never replaced: the behaviour weight
        pi_old / mu and the ``mismatch/*`` metrics still see how far the stale samples' policy
        was. In decoupled mode pi_old is already the current policy for every row, so
        ``Recompute`` adds nothing there.

        One pass per sample: the first epoch's minibatches hold every sample once. The first
        minibatch gets no pass here: it is flagged ``old_from_forward`` and its training forward
        (same weights, same layout) supplies pi_old. Later epochs' minibatches (re-shuffled,
        re-collated) read the values remembered by sample."""
        self._batch_first_step = self.global_step
        resumed, self._resumed_old = self._resumed_old, None
        if resumed is not None and self._continues(steps, resumed):
            # every minibatch looks its pi_old up by sample
            self._old_tokens = {key: digest for key, (digest, _) in resumed.items()}
            self._old_by_sample = {key: old.to(self.device) for key, (_, old) in resumed.items()}
        else:
            self._score_old_logprobs(steps)
        if self.kl_reward.enabled:
            self.last_kl_reward_penalty = self.kl_reward.apply(steps, self.ref_logprobs)
        return steps

    def _continues(self, steps: list[dict[str, Any]], old: dict[tuple[int, int], tuple[int, Any]]) -> bool:
        """Whether ``steps`` are the rest of the batch whose pi_old is ``old``: every row that
        needs pi_old has it, for the same tokens (a regenerated batch may reuse group ids)."""
        for batch in steps:
            keys = zip(batch["group_ids"].tolist(), batch["sample_indexes"].tolist())
            for i, (key, needed) in enumerate(zip(keys, self._old_rows(batch).tolist())):
                if needed and (key not in old or old[key][0] != token_digest(batch, i)):
                    return False
        return True

    def _score_old_logprobs(self, steps: list[dict[str, Any]]) -> None:
        self._old_by_sample, self._old_tokens = {}, {}
        for k, batch in enumerate(steps):
            rows = self._old_rows(batch)
            if not rows.any() or batch.get("epoch", 0) > 0:
                continue
            if k == 0:
                batch["old_from_forward"] = True
                continue
            fresh = torch.zeros_like(batch["behavior_logprobs"])
            idx = rows.nonzero().squeeze(1)
            sub = self.old_logprobs({n: batch[n][idx] for n in ("input_ids", "attention_mask")})
            fresh[idx] = sub
            self._set_old_logprobs(batch, fresh)

    def _old_rows(self, batch: dict[str, Any]) -> torch.Tensor:
        """Rows whose pi_old is the trainer's current policy (not mu)."""
        if self.needs_old_logprobs:
            return torch.ones_like(batch["recompute"])
        return batch["recompute"]

    def _set_old_logprobs(self, batch: dict[str, Any], fresh: torch.Tensor) -> None:
        """pi_old of the batch from ``fresh`` on its rows that need it (mu elsewhere), and
        remember it by sample for the later epochs."""
        rows = self._old_rows(batch)
        batch["old_logprobs"] = torch.where(rows[:, None], fresh, batch["behavior_logprobs"])
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        keys = zip(batch["group_ids"].tolist(), batch["sample_indexes"].tolist())
        for i, key in enumerate(keys):
            self._old_by_sample[key] = batch["old_logprobs"][i, : max(int(lengths[i]) - 1, 0)]
            self._old_tokens[key] = token_digest(batch, i)

    def _complete_old_logprobs(self, batch: dict[str, Any], logp: torch.Tensor) -> None:
        """Fill pi_old of a minibatch that has none yet: from its own training forward (the
        rollout batch's first minibatch) or from the values remembered by sample."""
        if batch.pop("old_from_forward", False):
            self._set_old_logprobs(batch, logp.detach())
        elif "old_logprobs" not in batch and (rows := self._old_rows(batch)).any():
            # only rows that need pi_old: a sample whose first-epoch minibatch needed none
            # (bypass, nothing flagged there) was never stored, and keeps mu
            old = batch["behavior_logprobs"].clone()
            keys = zip(batch["group_ids"].tolist(), batch["sample_indexes"].tolist())
            for i, (key, needed) in enumerate(zip(keys, rows.tolist())):
                if needed:
                    values = self._old_by_sample[key]
                    old[i, : len(values)] = values
            batch["old_logprobs"] = old

    def part_trained_old(self) -> list[list[Any]] | None:
        """pi_old of the rollout batch in training, when some but not all of its updates are
        done (the datamodule then saves the batch itself, ``data/rollout/handoff.py``): it was
        scored with the weights before the batch's first update, which a resumed run no longer
        has. As [group id, sample index, token digest, logprobs] (plain values: checkpoints load
        with ``weights_only``). Under DDP each rank's own samples; rank 0 writes the file, so
        the other ranks score theirs again on resume (docs/usage.md)."""
        done = self.global_step - self._batch_first_step
        if not self._steps or done <= 0:
            return None
        return [[g, i, self._old_tokens[g, i], t.detach().cpu()] for (g, i), t in self._old_by_sample.items()]

    def resume_old_logprobs(self, saved: list[list[Any]] | None) -> None:
        """The checkpoint's ``part_trained_old`` (None: the checkpoint fell between batches)."""
        self._resumed_old = None if saved is None else {(int(g), int(i)): (int(d), t) for g, i, d, t in saved}


def token_digest(batch: dict[str, Any], row: int) -> int:
    """A digest of a minibatch row's real tokens (which sample a saved pi_old belongs to)."""
    ids = batch["input_ids"][row][batch["attention_mask"][row] > 0]
    return zlib.crc32(ids.to(torch.int64).cpu().numpy().tobytes())
