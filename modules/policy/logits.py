"""Per-token logprobs of chosen positions, optionally without materialising full-vocabulary logits.

    python train.py module.forward.logit_chunk=1024   # at most 1024 positions' logits at a time

The textbook path (``logit_chunk: null``) runs the whole causal LM, so ``logits [N, V]`` exist
in full, plus a float32 upcast, the tempered copy and ``log_softmax`` (and two more for the
entropy): at 4 x 5,120 tokens and a 152K vocabulary each float32 copy is ~12 GB. With
``logit_chunk=C`` the model's trunk runs once (``get_decoder()``), only the positions that have a
target are kept, and the output head (``get_output_embeddings()``) is applied C positions at a
time inside ``torch.utils.checkpoint``: a chunk's logits exist only while its logprobs are
computed, and again, one chunk at a time, during backward. Peak memory for the head is then
O(C x V) instead of O(N x V), for one extra head matmul in backward.

The chunked path assumes ``logits = head(trunk(x))``, which holds for Llama / Qwen / Mistral
style models; one that post-processes logits (soft-capping, scaling) would differ, so the first
call per model compares both paths on its inputs and stops with a ``ConfigError`` naming
``module.forward.logit_chunk`` if they disagree. Equality (logprobs, entropy and gradients, in
float64) is tested in ``tests/unit/test_logits.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from modules.config.errors import check


def tempered_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / T)[target]`` over the last dim, in at least float32 (bf16 logits
    are upcast, float64 stays); entropy of the same distribution, without grad."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def _chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's logprobs and (without grad; empty when not asked) entropy, from one matmul."""
    logp, entropy = tempered_logprobs(F.linear(hidden, weight, bias), targets, temperature, with_entropy)
    return logp, (entropy if entropy is not None else logp.new_zeros(0)).detach()


class LogitHead:
    """Logprobs of ``targets`` at flat positions ``src`` of the model's output on ``inputs``."""

    CHECK_TOKENS = 64  # the first-use check compares this many positions of the first row

    def __init__(self, logit_chunk: int | None = None) -> None:
        check(
            "module.forward.logit_chunk",
            logit_chunk,
            logit_chunk is None or (isinstance(logit_chunk, int) and logit_chunk >= 1),
            "null (full logits) or an int >= 1 (positions per head chunk)",
        )
        self.logit_chunk = logit_chunk
        self._checked: set[int] = set()

    def __call__(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        src: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.logit_chunk is None:
            return self.full(model, inputs, src, targets, temperature, with_entropy)
        if id(model) not in self._checked:
            self.check_against_full(model, inputs, src, targets)
        return self.chunked(model, inputs, src, targets, temperature, with_entropy)

    @staticmethod
    def full(model, inputs, src, targets, temperature, with_entropy):
        logits = model(**inputs, use_cache=False).logits
        flat = logits.reshape(-1, logits.shape[-1]).index_select(0, src)
        return tempered_logprobs(flat, targets, temperature, with_entropy)

    def chunked(self, model, inputs, src, targets, temperature, with_entropy):
        trunk, head = model.get_decoder(), model.get_output_embeddings()
        hidden = trunk(**inputs, use_cache=False)[0]
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, src)
        c = int(self.logit_chunk or len(flat))
        logps, ents = [], []
        grad = torch.is_grad_enabled() and (flat.requires_grad or head.weight.requires_grad)
        for i in range(0, len(flat), c):
            args = (flat[i : i + c], head.weight, head.bias, targets[i : i + c], temperature, with_entropy)
            # under checkpoint only the chunk's inputs are kept; backward recomputes its logits
            logp, ent = checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args)
            logps.append(logp)
            ents.append(ent)
        if not logps:
            empty = flat.new_zeros(0, dtype=torch.promote_types(flat.dtype, torch.float32))
            return empty, (empty.clone() if with_entropy else None)
        return torch.cat(logps), (torch.cat(ents) if with_entropy else None)

    @torch.no_grad()
    def check_against_full(self, model, inputs, src, targets) -> None:
        """Once per model: the chunked head must score the first row's first ``CHECK_TOKENS``
        positions as the full model does. Only that prefix of the row is run (causal: the same
        values), so the check holds at most CHECK_TOKENS positions' logits; in full precision
        (autocast off), so the two paths' kernels cannot differ by bf16 rounding."""
        width = inputs["input_ids"].shape[1]
        first = src < min(width, self.CHECK_TOKENS)  # row 0's first positions of the output
        if not first.any():
            return  # row 0 scores nothing here: check on a later call
        cols = int(src[first].max()) + 1
        row = {k: v[:1, :cols] for k, v in inputs.items()}
        src0, tgt0 = src[first], targets[first]
        device = inputs["input_ids"].device.type
        with torch.autocast(device_type=device, enabled=False):
            ref, _ = self.full(model, row, src0, tgt0, 1.0, False)
            got, _ = self.chunked(model, row, src0, tgt0, 1.0, False)
        diff = float((got - ref).abs().max())
        precise = next(model.parameters()).dtype in (torch.float32, torch.float64)
        tolerance = 1e-3 if precise else 5e-2
        check(
            "module.forward.logit_chunk",
            self.logit_chunk,
            diff <= tolerance,
            f"null for this model: its logits are not head(trunk(x)) (chunked and full logprobs "
            f"differ by {diff:.2e} > {tolerance:g})",
        )
        self._checked.add(id(model))


def temperature_matches_sampling(cfg: Any) -> None:
    """Cross-field rule: the trainer's logprobs are ``log_softmax(logits / T)`` with the
    sampler's T, or behaviour and trainer logprobs would not be of the same distribution."""
    t, sampled = cfg.module.temperature, cfg.rollout.sampling.temperature
    allowed = f"equal to rollout.sampling.temperature={sampled} (logprobs must match)"
    check("module.temperature", t, t == sampled, allowed)
