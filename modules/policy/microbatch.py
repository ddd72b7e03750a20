"""Micro-batches: trainer memory that scales with a micro-batch, not the minibatch.

    python train.py algo.micro_batch_size=4                  # 4 sequences per micro-batch
    python train.py algo.micro_batch_size=4 module/forward=bucketed

``MicroBatched(forward, size)`` runs any forward strategy (``modules.policy.packing``) over the
minibatch ``size`` sequences at a time, each under ``torch.utils.checkpoint`` (non-reentrant):
the forward keeps only each micro-batch's inputs, and the backward recomputes one micro-batch's
activations at a time. Peak activation memory is one micro-batch's; the logprobs of the whole
minibatch (``[B, T-1]``, small) come back as one tensor and the loss is computed on them once.

Why this and not the usual gradient accumulation (one backward per micro-batch, each loss
scaled by its share): accumulation is exact only when the loss is a sum over sequences with
fixed normalisers. Some are not: a self-normalised correction divides by the minibatch's mean
weight, and ``seq_mean_token_mean`` or a group's statistics span micro-batches. Here the loss
is the full minibatch's, so the update is the same for every loss, correction and aggregation
(tested to float64 precision in ``tests/unit/test_microbatch.py``), and there is still one backward
per optimizer step, so DDP's one gradient all-reduce and Lightning's gradient clipping are
unchanged. The price is one more forward per micro-batch (about a third more compute than
forward + backward): pay it only when the minibatch's activations do not fit.

Without gradients (pi_old, the reference model, evaluation) there is nothing to recompute:
the micro-batches run one after another under ``no_grad`` and only their outputs are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from modules.config.errors import check

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def check_size(size: object) -> None:
    """``algo.micro_batch_size``: null or a positive int (start-up validation and the constructor)."""
    check(
        "algo.micro_batch_size",
        size,
        size is None or (isinstance(size, int) and not isinstance(size, bool) and size >= 1),
        "null (the whole minibatch at once) or an int >= 1 (sequences per micro-batch)",
    )


class MicroBatched:
    def __init__(self, forward: Forward, size: int | None) -> None:
        check_size(size)
        self.forward = forward
        self.size = size

    def __getattr__(self, name: str) -> Any:  # the wrapped strategy's attributes (head, ...)
        try:
            forward = self.__dict__["forward"]
        except KeyError:  # half-built (copy, pickle): no such attribute yet
            raise AttributeError(name) from None
        return getattr(forward, name)

    def __call__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b = input_ids.shape[0]
        if self.size is None or b <= self.size:
            return self.forward(model, input_ids, attention_mask, temperature, with_entropy)
        logps, ents = [], []
        for start in range(0, b, self.size):
            ids = input_ids[start : start + self.size]
            mask = attention_mask[start : start + self.size]
            if torch.is_grad_enabled():
                logp, ent = checkpoint(
                    self.forward, model, ids, mask, temperature, with_entropy, use_reentrant=False
                )
            else:
                logp, ent = self.forward(model, ids, mask, temperature, with_entropy)
            logps.append(logp)
            ents.append(ent)
        return torch.cat(logps), torch.cat(ents) if with_entropy else None  # type: ignore[arg-type]
