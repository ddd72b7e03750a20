"""Checkpointed micro-batches give the full minibatch's update, where plain accumulation does not.

The equality for every aggregation x correction x objective is in ``tests/unit/test_packing.py``
(micro-batched layouts are part of its table); here: the case that motivates the design (a
self-normalised correction, whose normaliser spans micro-batches), memory that is actually
released, no-grad passes, and bad sizes.
"""

from __future__ import annotations

import pytest
import torch

from modules.config.errors import ConfigError
from modules.policy.microbatch import MicroBatched
from modules.policy.packing import PackedForward
from tests.unit.test_packing import build_loss, loss_and_grads, model64, ragged_batch  # noqa: F401


def accumulated(model, loss_fn, batch, size: int) -> list[torch.Tensor]:
    """Textbook gradient accumulation: one loss and backward per micro-batch, each with the
    minibatch's normalisers (``totals``) so that plain token sums add up."""
    from modules.algo.losses import batch_counts

    model.zero_grad()
    totals = batch_counts(batch["loss_mask"]).double()
    b = batch["input_ids"].shape[0]
    for s in range(0, b, size):
        rows = slice(s, s + size)
        logp, _ = PackedForward()(model, batch["input_ids"][rows], batch["attention_mask"][rows], 0.8)
        with torch.no_grad():
            old = PackedForward()(model, batch["input_ids"][rows], batch["attention_mask"][rows], 0.8)[0]
        loss, _ = loss_fn(
            logp,
            batch["behavior_logprobs"][rows],
            batch["advantages"][rows],
            batch["loss_mask"][rows],
            weights=batch["weights"][rows],
            staleness=batch["staleness"][rows],
            totals=totals,
            old_logp=old,
        )
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_self_normalised_correction_same_update_where_accumulation_is_not(model64):  # noqa: F811
    loss_fn = build_loss(
        ["algo/correction=tis", "algo.correction.self_normalize=true", "algo.loss.anchor=decoupled"]
    )
    batch = ragged_batch(seed=4)
    _, _, full = loss_and_grads(model64, loss_fn, PackedForward(), batch)
    _, _, micro = loss_and_grads(model64, loss_fn, MicroBatched(PackedForward(), 3), batch)
    for g, r in zip(micro, full):
        assert torch.allclose(g, r, rtol=1e-9, atol=1e-12)
    naive = accumulated(model64, loss_fn, batch, 3)
    gap = max(float((g - r).abs().max()) for g, r in zip(naive, full))
    assert gap > 1e-6  # the per-micro-batch mean weight is not the minibatch's


def test_no_grad_passes_run_micro_batches_without_checkpointing(model64):  # noqa: F811
    batch = ragged_batch(seed=5)
    ids, am = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        ref, ref_ent = PackedForward()(model64, ids, am, 1.0, with_entropy=True)
        got, ent = MicroBatched(PackedForward(), 4)(model64, ids, am, 1.0, with_entropy=True)
    assert not got.requires_grad
    assert torch.allclose(got, ref, rtol=0, atol=1e-12) and torch.allclose(ent, ref_ent, rtol=0, atol=1e-12)


def test_backward_recomputes_one_micro_batch_at_a_time_and_keeps_only_inputs(model64):  # noqa: F811
    """Peak activation memory is one micro-batch's: between forward and backward autograd keeps
    only the checkpoints' inputs (not every layer's activations), and the backward recomputes
    the micro-batches one by one, each with at most ``size`` sequences. (Actual peak RSS:
    ``python -m lab.memory --micro``, docs/gpu.md.)"""
    batch = ragged_batch(seed=6, n=12)
    ids, am = batch["input_ids"], batch["attention_mask"]
    calls: list[tuple[bool, int]] = []

    def recording(model, i, m, t, e):  # the forward strategy, recording each call
        calls.append((torch.is_grad_enabled(), int(i.shape[0])))
        return PackedForward()(model, i, m, t, e)

    def kept_bytes(layout) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            if not isinstance(t, torch.nn.Parameter):
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, _ = layout(model64, ids, am, 1.0)
        return total, logp

    full, logp = kept_bytes(PackedForward())
    logp.sum().backward()
    micro, logp = kept_bytes(MicroBatched(recording, 5))
    assert micro < full / 50, (micro, full)  # inputs only
    assert calls == [(True, 5), (True, 5), (True, 2)]  # the forward: one call per micro-batch
    logp.sum().backward()
    assert sorted(calls[3:]) == sorted(calls[:3]) and len(calls) == 6  # once more each, in backward


def test_micro_batched_forward_copies_and_pickles():
    import copy
    import pickle

    m = MicroBatched(PackedForward(row_tokens=8), 3)
    for clone in (copy.copy(m), copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert clone.size == 3 and clone.row_tokens == 8  # the strategy's fields pass through


@pytest.mark.parametrize("size", [0, -2, 1.5, True, "4"])
def test_bad_micro_batch_size_names_the_field(size):
    with pytest.raises(ConfigError, match="algo.micro_batch_size"):
        MicroBatched(PackedForward(), size)
    from modules.launch.validate import validate
    from tests.conftest import compose

    if not isinstance(size, str):  # (on the command line "4" is the int 4)
        with pytest.raises(ConfigError, match="algo.micro_batch_size"):  # at start-up, before any build
            validate(compose([f"algo.micro_batch_size={str(size).lower()}"]))


def test_module_config_builds_the_micro_batched_forward():
    from modules.launch.compose import build
    from tests.conftest import compose

    cfg = compose(["algo.micro_batch_size=2"])
    cfg.module.model_path = "unused"  # the policy loads in configure_model, not here
    module = build(cfg.module)
    assert isinstance(module.forward_logprobs, MicroBatched) and module.forward_logprobs.size == 2
    assert isinstance(build(compose([]).module).forward_logprobs, PackedForward)


def test_trunk_gradient_checkpointing_gives_the_same_update(model64):  # noqa: F811
    """``module.gradient_checkpointing``: transformers' per-layer recompute, alone and inside
    micro-batches, changes no logprob, loss or gradient."""
    import copy

    loss_fn = build_loss(["algo/correction=tis", "algo.loss.anchor=decoupled"])
    batch = ragged_batch(seed=7)
    ref_loss, _, ref = loss_and_grads(model64, loss_fn, PackedForward(), batch)
    ckpt = copy.deepcopy(model64)
    ckpt.gradient_checkpointing_enable({"use_reentrant": False})
    assert ckpt.is_gradient_checkpointing
    for layout in (PackedForward(), MicroBatched(PackedForward(), 4)):
        loss, _, grads = loss_and_grads(ckpt, loss_fn, layout, batch)
        assert torch.allclose(loss, ref_loss, rtol=1e-10, atol=1e-12)
        for g, r in zip(grads, ref):
            assert torch.allclose(g, r, rtol=1e-9, atol=1e-12)


def test_module_enables_gradient_checkpointing_from_config(models):
    from modules.launch.compose import build
    from tests.conftest import compose

    with pytest.raises(ConfigError, match="module.gradient_checkpointing"):
        build(compose(["module.gradient_checkpointing=3"]).module)
    cfg = compose(["module.gradient_checkpointing=true", "module.ref_model_path=null", "algo.loss.kl_coef=0"])
    cfg.module.model_path = str(models["untied"])
    module = build(cfg.module)
    module.configure_model()
    assert module.policy.is_gradient_checkpointing and module.policy.training
