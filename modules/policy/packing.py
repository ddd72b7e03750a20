"""How the trainer runs the policy over a minibatch: padded, packed, or length-bucketed.

    python train.py module/forward=packed      # the default: padding-free rows
    python train.py module/forward=bucketed    # length-sorted micro-batches (any attention backend)
    python train.py module/forward=padded      # one right-padded [B, T] batch (the reference)

Every strategy returns per-token logprobs in the *padded* layout ``[B, T-1]`` that ``collate``
produces (entry ``[i, t]`` is ``log p(input_ids[i, t+1] | input_ids[i, :t+1])``; zero where
``attention_mask`` is 0), so losses, corrections and metrics never see how the forward pass
was laid out. Only the FLOPs change: with a long-tailed length distribution a padded batch is
mostly padding (128 responses of mean 14 tokens padded to the longest, ~200).

``PackedForward`` concatenates sequences into rows of at most ``row_tokens`` tokens (first-fit
decreasing; a sequence longer than ``row_tokens`` gets a row of its own) with ``position_ids``
restarting at 0 for each sequence and no 2D attention mask. transformers then builds a
block-diagonal causal mask from the position ids (sdpa / eager / flex), so no token attends
across a sequence boundary and each sequence sees exactly the positions it sees when padded.
Attention over a masked row is dense, so its cost per token grows with the row length: rows
as long as the longest sequence (the default) remove nearly all padding and keep that small.
With ``flash_attention_2`` / ``_3`` transformers reads sequence boundaries from position ids
only in a single row, so every sequence goes into one row there (the varlen kernel has no
quadratic cost). The first call per model checks packed against padded logprobs on a few of
the batch's sequences and stops with a ``ConfigError`` if they differ, which is what a model
whose attention ignores packed position ids gives (use ``module/forward=bucketed`` there).

``BucketedForward`` is the fallback for models that do not read packed position ids: sort by
length, cut into micro-batches of at most ``token_budget`` padded tokens, run each padded.

Equality with the padded computation (logprobs, loss and gradients, float64, every aggregation
and correction) is tested in ``tests/unit/test_packing.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modules.config.errors import check
from modules.policy.logits import LogitHead


def _scatter(values: torch.Tensor, dst: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A ``shape`` tensor of zeros with ``values`` written at flat positions ``dst``."""
    out = values.new_zeros(shape[0] * shape[1])
    return out.index_copy(0, dst, values).view(shape)


def _empty(input_ids: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    z = torch.zeros((input_ids.shape[0], max(input_ids.shape[1] - 1, 0)), device=input_ids.device)
    return z, (z.clone() if with_entropy else None)


class PaddedForward:
    """One forward over the right-padded ``[B, T]`` batch (the reference layout)."""

    def __init__(self, logit_chunk: int | None = None) -> None:
        self.head = LogitHead(logit_chunk)

    def __call__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if input_ids.shape[0] == 0 or input_ids.shape[1] < 2:
            return _empty(input_ids, with_entropy)
        b, t = input_ids.shape
        real = attention_mask[:, 1:] > 0  # a target exists where the next token is real
        dst = real.reshape(-1).nonzero().squeeze(1)  # flat [B, T-1] positions scored
        src = dst // (t - 1) * t + dst % (t - 1)  # the same positions in the [B, T] output
        targets = input_ids[:, 1:].reshape(-1).index_select(0, dst)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        logp, entropy = self.head(model, inputs, src, targets, temperature, with_entropy)
        shape = (b, t - 1)
        return _scatter(logp, dst, shape), None if entropy is None else _scatter(entropy, dst, shape)


@dataclass
class PackPlan:
    """Where each sequence sits in the packed rows, and the flat index maps of its targets."""

    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L]
    src: torch.Tensor  # flat indexes into the packed logits [R * L] (the predicting positions)
    dst: torch.Tensor  # flat indexes into the padded output [B * (T-1)]
    targets: torch.Tensor  # the token each predicting position is scored on


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of sequence indexes whose lengths sum to at most ``capacity`` (a longer sequence
    gets a bin of its own), longest first. Deterministic: ties keep index order."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def pack_plan(input_ids: torch.Tensor, attention_mask: torch.Tensor, row_tokens: int) -> PackPlan:
    """Lay the sequences of a right-padded batch end to end in rows of ``row_tokens`` tokens."""
    b, t = input_ids.shape
    lengths = [int(n) for n in attention_mask.sum(dim=1).tolist()]
    bins = first_fit_decreasing(lengths, row_tokens)
    width = max(max(sum(lengths[i] for i in row) for row in bins), 2)
    ids = torch.zeros((len(bins), width), dtype=input_ids.dtype, device=input_ids.device)
    pos = torch.zeros((len(bins), width), dtype=torch.long, device=input_ids.device)
    src, dst = [], []
    for r, row in enumerate(bins):
        col = 0
        for i in row:
            n = int(lengths[i])
            ids[r, col : col + n] = input_ids[i, :n]
            pos[r, col : col + n] = torch.arange(n, device=input_ids.device)
            if n > 1:  # targets 0..n-2, predicted at packed columns col..col+n-2
                src.append(torch.arange(r * width + col, r * width + col + n - 1))
                dst.append(torch.arange(i * (t - 1), i * (t - 1) + n - 1))
            col += n
        # the row's tail (token 0): a pseudo-sequence of its own (positions restart), never read
        pos[r, col:] = torch.arange(width - col, device=input_ids.device)
    device = input_ids.device
    src_t = torch.cat(src).to(device) if src else torch.zeros(0, dtype=torch.long, device=device)
    dst_t = torch.cat(dst).to(device) if dst else torch.zeros(0, dtype=torch.long, device=device)
    targets = ids.reshape(-1)[src_t + 1]
    return PackPlan(ids, pos, src_t, dst_t, targets)


FLASH = ("flash_attention_2", "flash_attention_3")


class PackedForward:
    """Padding-free forward: sequences packed into rows with restarting position ids."""

    CHECK_SEQUENCES = 4  # the first call per model compares this many sequences with padded

    def __init__(self, row_tokens: int | None = None, logit_chunk: int | None = None) -> None:
        self.head = LogitHead(logit_chunk)
        check(
            "module.forward.row_tokens",
            row_tokens,
            row_tokens is None or (isinstance(row_tokens, int) and row_tokens >= 2),
            "null (the minibatch's longest sequence) or an int >= 2",
        )
        self.row_tokens = row_tokens
        self._checked: set[int] = set()

    def capacity(self, model: torch.nn.Module, lengths: torch.Tensor) -> int:
        """Row length in tokens: everything in one row under flash attention (boundaries
        come from position ids only for a single row), else ``row_tokens`` or the longest."""
        attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if attn in FLASH:
            return max(int(lengths.sum()), 2)
        return max(self.row_tokens or 0, int(lengths.max()), 2)

    def __call__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = input_ids.shape
        if b == 0 or t < 2:
            return _empty(input_ids, with_entropy)
        if id(model) not in self._checked:
            self.check_against_padded(model, input_ids, attention_mask)
        plan = pack_plan(input_ids, attention_mask, self.capacity(model, attention_mask.sum(dim=1)))
        return self.run(model, plan, (b, t - 1), temperature, with_entropy)

    def run(
        self,
        model: torch.nn.Module,
        plan: PackPlan,
        shape: tuple[int, int],
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed forward of ``plan``, scattered back to the padded ``shape``."""
        # attention_mask=None: transformers derives the block-diagonal mask from position_ids
        inputs = {"input_ids": plan.input_ids, "position_ids": plan.position_ids}
        logp, entropy = self.head(model, inputs, plan.src, plan.targets, temperature, with_entropy)
        return _scatter(logp, plan.dst, shape), None if entropy is None else _scatter(
            entropy, plan.dst, shape
        )

    @torch.no_grad()
    def check_against_padded(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> None:
        """Once per model: a few sequences packed into one row must score as they do padded."""
        rows = (attention_mask.sum(dim=1) >= 2).nonzero().squeeze(1)[: self.CHECK_SEQUENCES]
        if len(rows) < 2:
            return  # nothing to pack together yet: check on a later call
        ids, am = input_ids[rows], attention_mask[rows]
        # in the parameters' precision: under bf16 autocast (trainer.precision=bf16-mixed) two
        # layouts differ by rounding, which is not what this check is about
        with torch.no_grad(), torch.autocast(input_ids.device.type, enabled=False):
            ref, _ = PaddedForward()(model, ids, am)
            got, _ = self.run(model, pack_plan(ids, am, max(int(am.sum()), 2)), ref.shape, 1.0, False)
        diff = float((got - ref).abs().max())
        precise = next(model.parameters()).dtype in (torch.float32, torch.float64)
        tolerance = 1e-3 if precise else 5e-2
        check(
            "module.forward",
            "packed",
            diff <= tolerance,
            f"bucketed or padded for this model: packed sequences score differently from padded "
            f"ones (max |diff| {diff:.2e} > {tolerance:g}), so its attention ignores packed position ids",
        )
        self._checked.add(id(model))


class BucketedForward:
    """Length-sorted micro-batches of at most ``token_budget`` padded tokens, each run padded
    (exact on any attention backend; some padding remains inside each micro-batch)."""

    def __init__(self, token_budget: int = 4096, logit_chunk: int | None = None) -> None:
        check(
            "module.forward.token_budget",
            token_budget,
            isinstance(token_budget, int) and token_budget >= 1,
            "an int >= 1",
        )
        self.token_budget = token_budget
        self.padded = PaddedForward(logit_chunk)

    def buckets(self, lengths: list[int]) -> list[list[int]]:
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        out: list[list[int]] = []
        for i in order:  # longest first: a bucket's first sequence sets its width
            if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= self.token_budget:
                out[-1].append(i)
            else:
                out.append([i])
        return out

    def __call__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = input_ids.shape
        if b == 0 or t < 2:
            return _empty(input_ids, with_entropy)
        lengths = [int(n) for n in attention_mask.sum(dim=1).tolist()]
        logps, ents, dsts = [], [], []
        for rows in self.buckets(lengths):
            width = max(lengths[rows[0]], 2)
            idx = torch.tensor(rows, device=input_ids.device)
            lp, ent = self.padded(
                model, input_ids[idx, :width], attention_mask[idx, :width], temperature, with_entropy
            )
            valid = attention_mask[idx, 1:width] > 0  # target t exists when token t+1 is real
            cols = torch.arange(width - 1, device=input_ids.device).expand(len(rows), -1)
            dsts.append((idx[:, None] * (t - 1) + cols)[valid])
            logps.append(lp[valid])
            if ent is not None:
                ents.append(ent[valid])
        dst = torch.cat(dsts)
        shape = (b, t - 1)
        logp = _scatter(torch.cat(logps), dst, shape)
        return logp, _scatter(torch.cat(ents), dst, shape) if with_entropy else None
