"""Padding-free training equals padded training: logprobs, loss and gradients, in float64.

Micro-batched training (``modules/policy/microbatch.py``) is one more layout here: the same numbers.

The forward layouts of ``modules/policy/packing.py`` (packed rows with restarting position ids,
length-bucketed micro-batches) must give the padded computation's numbers for every loss the
project can configure: each aggregation x each correction (and each objective under one
aggregation), with the decoupled anchor where the correction needs pi_old, computed by the
same layout as the module does. Also the packing plan itself: every token once, rows bounded.
"""

from __future__ import annotations

import random

import pytest
import torch

from data.rollout.experience import Experience, collate
from modules.policy.microbatch import MicroBatched
from modules.policy.packing import (
    BucketedForward,
    PackedForward,
    PaddedForward,
    first_fit_decreasing,
    pack_plan,
)
from tests.conftest import ROOT, compose

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")

CORRECTIONS = sorted(p.stem for p in (ROOT / "conf/algo/correction").glob("*.yaml"))

OBJECTIVES = sorted(p.stem for p in (ROOT / "conf/algo/objective").glob("*.yaml"))

LAYOUTS = {
    "packed": PackedForward(),
    "packed_long_rows": PackedForward(row_tokens=64),
    "packed_tiny_rows": PackedForward(row_tokens=2),  # one sequence per row
    "bucketed": BucketedForward(token_budget=40),
    # the output head applied a few positions at a time (modules/policy/logits.py)
    "padded_logit_chunks": PaddedForward(logit_chunk=5),
    "packed_logit_chunks": PackedForward(logit_chunk=7),
    "bucketed_logit_chunks": BucketedForward(token_budget=40, logit_chunk=3),
    # checkpointed micro-batches (modules/policy/microbatch.py): uneven, one sequence, nested chunking
    "micro_packed_3": MicroBatched(PackedForward(), 3),
    "micro_padded_1": MicroBatched(PaddedForward(), 1),
    "micro_bucketed_4_logit_chunks": MicroBatched(BucketedForward(token_budget=40, logit_chunk=3), 4),
}


def tiny_qwen(hidden: int = 32) -> torch.nn.Module:
    """A tiny random float32 Qwen2 in train mode with dropout off (as the trainer runs)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from modules.policy.hf_policy import disable_dropout

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
    )
    model = Qwen2ForCausalLM(cfg)
    disable_dropout(model)
    return model.train()


@pytest.fixture(scope="module")
def model64(tmp_path_factory):
    """``tiny_qwen`` in float64."""
    return tiny_qwen().double()


def ragged_batch(seed: int = 0, n: int = 10) -> dict:
    """Responses of very different lengths (1 to 30 tokens) after prompts of 1 to 6 tokens,
    with partial loss masks, stale versions and per-sample weights: float64 tensors."""
    rng = random.Random(seed)
    exps = []
    for i in range(n):
        r = [1, 30, 2, 17][i] if i < 4 else rng.randint(1, 25)
        p = rng.randint(1, 6)
        exps.append(
            Experience(
                prompt_id=i,
                group_id=i // 5,
                sample_index=i % 5,
                prompt_ids=[rng.randint(3, 60) for _ in range(p)],
                response_ids=[rng.randint(3, 60) for _ in range(r)],
                behavior_logprobs=[-rng.uniform(0.1, 4.0) for _ in range(r)],
                reward=float(i % 2),
                policy_version=0,
                sampling={},
                gen_start=0.0,
                gen_end=1.0,
                truncated=False,
                advantage=rng.uniform(-1.5, 1.5),
                loss_mask=[int(rng.random() > 0.2) for _ in range(r)],
                weight=rng.uniform(0.5, 1.0),
                staleness=i % 4,
            )
        )
    batch = collate(exps, pad_id=0)
    for k in ("loss_mask", "behavior_logprobs", "advantages", "weights"):
        batch[k] = batch[k].double()
    return batch


def loss_and_grads(model, loss_fn, layout, batch) -> tuple[torch.Tensor, dict, list[torch.Tensor]]:
    model.zero_grad()
    ids, am = batch["input_ids"], batch["attention_mask"]
    extra = {}
    if loss_fn.needs_old_logprobs:
        with torch.no_grad():
            extra["old_logp"] = layout(model, ids, am, 0.8)[0]
    logp, _ = layout(model, ids, am, 0.8)
    loss, metrics = loss_fn(
        logp,
        batch["behavior_logprobs"],
        batch["advantages"],
        batch["loss_mask"],
        weights=batch["weights"],
        staleness=batch["staleness"],
        **extra,
    )
    loss.backward()
    return loss.detach(), metrics, [p.grad.clone() for p in model.parameters()]


def assert_same(model, loss_fn, batch) -> None:
    ref_loss, ref_metrics, ref_grads = loss_and_grads(model, loss_fn, PaddedForward(), batch)
    assert any(g.abs().sum() > 0 for g in ref_grads)
    for name, layout in LAYOUTS.items():
        loss, metrics, grads = loss_and_grads(model, loss_fn, layout, batch)
        assert torch.allclose(loss, ref_loss, rtol=1e-10, atol=1e-12), name
        for key, value in ref_metrics.items():
            assert torch.allclose(
                torch.as_tensor(metrics[key]), torch.as_tensor(value), rtol=1e-9, atol=1e-12
            ), (
                name,
                key,
            )
        for g, r in zip(grads, ref_grads):
            assert torch.allclose(g, r, rtol=1e-9, atol=1e-12), name


def build_loss(overrides: list[str]):
    from hydra.utils import instantiate

    return instantiate(compose(overrides).algo.loss)


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_every_aggregation_and_correction_matches_padded(model64, aggregation, correction):
    anchor = "bypass" if correction in ("none", "ds_seq_mask", "lag") else "decoupled"
    loss_fn = build_loss(
        [
            f"algo/correction={correction}",
            f"algo.loss.aggregation={aggregation}",
            f"algo.loss.anchor={anchor}",
            "algo.loss.norm_const=32",
        ]
    )
    assert_same(model64, loss_fn, ragged_batch())


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_every_objective_matches_padded(model64, objective):
    assert_same(model64, build_loss([f"algo/objective={objective}"]), ragged_batch(seed=1))


def test_logprobs_and_entropy_match_padded_and_padding_reads_zero(model64):
    batch = ragged_batch(seed=2)
    ids, am = batch["input_ids"], batch["attention_mask"]
    ref, ref_ent = PaddedForward()(model64, ids, am, 0.7, with_entropy=True)
    real = am[:, 1:] > 0
    assert not ref[~real].any() and not ref_ent[~real].any()  # no target there: zero
    for name, layout in LAYOUTS.items():
        logp, ent = layout(model64, ids, am, 0.7, with_entropy=True)
        assert logp.shape == ref.shape and ent.shape == ref.shape, name
        assert torch.allclose(logp[real], ref[real], rtol=0, atol=1e-12), name
        assert torch.allclose(ent[real], ref_ent[real], rtol=0, atol=1e-12), name
        assert not logp[~real].any(), name  # no target there: never a stray value


def test_the_padded_reference_is_what_a_lone_sequence_gets(model64):
    """Independent of any layout code: each sequence run alone, unpadded."""
    batch = ragged_batch(seed=3)
    ids, am = batch["input_ids"], batch["attention_mask"]
    logp, _ = PackedForward()(model64, ids, am, 1.0)
    for i in range(ids.shape[0]):
        n = int(am[i].sum())
        alone = torch.log_softmax(model64(input_ids=ids[i : i + 1, :n], use_cache=False).logits[0, :-1], -1)
        expected = alone.gather(-1, ids[i, 1:n, None]).squeeze(-1)
        assert torch.allclose(logp[i, : n - 1], expected, rtol=0, atol=1e-12)


def test_pack_plan_places_every_token_once_in_bounded_rows():
    g = torch.Generator().manual_seed(0)
    lengths = [1, 2, 40, 7, 7, 3, 25, 16, 1, 9]
    b, t = len(lengths), max(lengths)
    ids = torch.randint(3, 60, (b, t), generator=g)
    am = torch.zeros(b, t, dtype=torch.long)
    for i, n in enumerate(lengths):
        am[i, :n] = 1
    plan = pack_plan(ids, am, row_tokens=40)
    assert plan.input_ids.shape[1] == 40  # the longest sequence fills a row of its own
    assert len(plan.dst) == sum(n - 1 for n in lengths) == len(set(plan.dst.tolist()))
    # the predicted token at each source position is the sequence's next token
    assert torch.equal(plan.targets, ids[:, 1:].reshape(-1)[plan.dst])
    bins = first_fit_decreasing(lengths, 40)
    assert sorted(i for row in bins for i in row) == list(range(b))
    assert all(sum(lengths[i] for i in row) <= 40 for row in bins)
    assert len(bins) == -(-sum(lengths) // 40)  # first-fit decreasing is tight here
    assert first_fit_decreasing([50, 3], 10) == [[0], [1]]  # too long: a row of its own


def test_a_model_that_ignores_packed_position_ids_is_refused(model64):
    """Packing relies on the model building its mask from position ids; one that does not
    (here: a wrapper that drops them) would silently attend across sequences."""
    from modules.config.errors import ConfigError

    class DropsPositions(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)

    batch = ragged_batch(seed=4)
    with pytest.raises(ConfigError, match="module.forward"):
        PackedForward()(DropsPositions(model64), batch["input_ids"], batch["attention_mask"])
    PackedForward()(model64, batch["input_ids"], batch["attention_mask"])  # the real one passes


def test_flash_attention_packs_everything_into_one_row(model64):
    """transformers' flash path reads sequence boundaries from position ids only for one row."""
    lengths = torch.tensor([5, 30, 2, 9])
    forward = PackedForward(row_tokens=8)
    assert forward.capacity(model64, lengths) == 30  # sdpa: the longest sequence
    impl = model64.config._attn_implementation
    try:
        model64.config._attn_implementation = "flash_attention_2"
        assert forward.capacity(model64, lengths) == 46  # everything in one row
    finally:
        model64.config._attn_implementation = impl


def test_empty_batches_give_empty_logprobs(model64):
    ids = torch.zeros((0, 5), dtype=torch.long)
    for layout in (PaddedForward(), *LAYOUTS.values()):
        logp, ent = layout(model64, ids, torch.zeros_like(ids), 1.0, with_entropy=True)
        assert logp.shape == (0, 4) and ent.shape == (0, 4)


def test_bad_row_settings_name_the_field():
    from modules.config.errors import ConfigError

    with pytest.raises(ConfigError, match="module.forward.row_tokens"):
        PackedForward(row_tokens=1)
    with pytest.raises(ConfigError, match="module.forward.token_budget"):
        BucketedForward(token_budget=0)


def test_first_use_check_passes_under_bf16_autocast():
    """trainer.precision=bf16-mixed runs the forward under autocast: the packed-vs-padded check
    must compare in the parameters' precision, not fail on bf16 rounding and blame attention."""
    model = tiny_qwen(hidden=64)
    batch = ragged_batch(seed=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = PackedForward()(model, batch["input_ids"], batch["attention_mask"], 1.0)
    assert torch.isfinite(logp).all()
