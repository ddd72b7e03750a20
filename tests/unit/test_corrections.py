"""Off-policy corrections, objectives, aggregation and KL: hand values, gradients, invariants."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from modules.algo import corrections as C
from modules.algo.losses import aggregate, cispo, gmpo, gspo, kl_penalty, policy_loss, ppo_clip, reinforce

ALL_CORRECTIONS = [
    C.NoCorrection(),
    C.TokenIS(),
    C.TruncatedTokenIS(2.0),
    C.SequenceIS(),
    C.SequenceIS(cap=2.0),
    C.GeometricSequenceIS(),
    C.MaskedIS(0.5, 2.0, "token"),
    C.MaskedIS(0.5, 2.0, "sequence"),
    C.MaskedIS(0.5, 2.0, "geometric"),
    C.IcePop(),
    C.DeepSeekSequenceMask(0.1),
    C.M2PO(0.04),
    C.VTrace(1.0, 1.0),
    C.LagWeight(0.9),
    C.TokenIS(self_normalize=True),
]

OBJECTIVES = [ppo_clip, partial(ppo_clip, dual_clip=3.0), cispo, gspo, gmpo, reinforce]


def call(corr, log_w, mask, **ctx):
    ctx.setdefault("logp", torch.zeros_like(log_w))
    ctx.setdefault("behavior_logp", torch.zeros_like(log_w))
    ctx.setdefault("advantages", torch.ones(log_w.shape[0]))
    ctx.setdefault("staleness", torch.zeros(log_w.shape[0]))
    return corr(log_w, mask, **ctx)


def test_hand_values_of_token_and_sequence_weights():
    log_w = torch.log(torch.tensor([[0.5, 4.0, 1.0]]))
    mask = torch.ones(1, 3)
    assert torch.allclose(call(C.TokenIS(), log_w, mask)[0], torch.tensor([[0.5, 4.0, 1.0]]))
    assert torch.allclose(call(C.TruncatedTokenIS(2.0), log_w, mask)[0], torch.tensor([[0.5, 2.0, 1.0]]))
    assert torch.allclose(call(C.SequenceIS(), log_w, mask)[0], torch.full((1, 3), 2.0))  # 0.5 * 4 * 1
    assert torch.allclose(call(C.SequenceIS(cap=1.5), log_w, mask)[0], torch.full((1, 3), 1.5))
    assert torch.allclose(call(C.GeometricSequenceIS(), log_w, mask)[0], torch.full((1, 3), 2.0 ** (1 / 3)))
    assert torch.allclose(call(C.MaskedIS(0.6, 2.0), log_w, mask)[0], torch.tensor([[0.0, 0.0, 1.0]]))
    assert torch.allclose(call(C.IcePop(0.5, 5.0), log_w, mask)[0], torch.tensor([[0.5, 4.0, 1.0]]))
    # V-trace: min(rho_bar, w_t) * prod_{s<t} min(c_bar, w_s)
    assert torch.allclose(call(C.VTrace(1.0, 1.0), log_w, mask)[0], torch.tensor([[0.5, 0.5, 0.5]]))
    # lag is a gate: gamma ** staleness times the token behaviour weight pi_old / mu
    lag = call(C.LagWeight(0.5), log_w, mask, staleness=torch.tensor([2]))[0]
    assert torch.allclose(lag, 0.25 * torch.tensor([[0.5, 4.0, 1.0]]))
    assert torch.allclose(
        call(C.LagWeight(0.5), torch.zeros(1, 3), mask, staleness=torch.tensor([2]))[0],
        torch.full((1, 3), 0.25),
    )


def test_padding_is_ignored_by_sequence_weights():
    log_w = torch.log(torch.tensor([[2.0, 3.0, 100.0]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, _ = call(C.SequenceIS(), log_w, mask)
    assert torch.allclose(w, torch.tensor([[6.0, 6.0, 0.0]]))


def test_deepseek_mask_drops_negative_off_policy_sequences_only():
    mask = torch.ones(3, 2)
    behavior = torch.zeros(3, 2)
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-0.01, -0.01]])  # mean log(mu/pi) = 1, 1, 0.01
    adv = torch.tensor([-1.0, 1.0, -1.0])
    w, _ = call(
        C.DeepSeekSequenceMask(0.1),
        torch.zeros(3, 2),
        mask,
        logp=logp,
        behavior_logp=behavior,
        advantages=adv,
    )
    assert w[:, 0].tolist() == [0.0, 1.0, 1.0]


def test_m2po_masks_largest_squared_log_ratios_until_mean_below_tau():
    log_w = torch.tensor([[0.0, 0.1, 1.0, 0.5]])  # squares 0, .01, 1, .25
    w, m = call(C.M2PO(tau=0.04), log_w, torch.ones(1, 4))
    assert w.tolist() == [[1.0, 1.0, 0.0, 0.0]]  # drop 1 (mean .0867), then .25 (mean .005)
    assert math.isclose(m["is/zeroed_frac"].item(), 0.5)


def test_self_normalisation_and_ess():
    log_w = torch.log(torch.tensor([[1.0, 3.0], [1.0, 3.0]]))
    w, m = call(C.TokenIS(self_normalize=True), log_w, torch.ones(2, 2))
    assert math.isclose(w.mean().item(), 1.0, rel_tol=1e-6)
    assert math.isclose(m["is/ess_frac"].item(), (8**2) / (4 * 20), rel_tol=1e-6)
    _, m1 = call(C.NoCorrection(), log_w, torch.ones(2, 2))
    assert math.isclose(m1["is/ess_frac"].item(), 1.0)
    assert m1["mismatch/max_abs_logp_diff"].item() == pytest.approx(math.log(3))


@pytest.mark.parametrize("corr", ALL_CORRECTIONS, ids=lambda c: type(c).__name__)
@pytest.mark.parametrize("obj", OBJECTIVES, ids=lambda o: getattr(o, "__name__", "ppo_dual"))
@pytest.mark.parametrize("anchor", ["bypass", "decoupled"])
def test_on_policy_every_correction_reduces_to_the_plain_loss(corr, obj, anchor):
    torch.manual_seed(0)
    base = torch.randn(3, 5) - 2
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0]])
    adv = torch.tensor([1.0, -0.5, 2.0])

    def run(correction):
        logp = base.clone().requires_grad_(True)
        loss, _ = policy_loss(
            logp,
            base.clone(),
            adv,
            mask,
            objective=obj,
            correction=correction,
            anchor=anchor,
            old_logp=base.clone(),
        )
        loss.backward()
        return loss.detach(), logp.grad

    ref_loss, ref_grad = run(None)
    loss, grad = run(corr)
    assert torch.allclose(loss, ref_loss, atol=1e-6) and torch.allclose(grad, ref_grad, atol=1e-6)


@pytest.mark.parametrize("corr", ALL_CORRECTIONS, ids=lambda c: type(c).__name__)
@pytest.mark.parametrize("obj", OBJECTIVES, ids=lambda o: getattr(o, "__name__", "ppo_dual"))
def test_extreme_log_ratios_stay_finite(corr, obj):
    logp = torch.tensor([[-80.0, 0.0, -1e-3], [0.0, -200.0, -5.0]], requires_grad=True)
    behavior = torch.tensor([[0.0, -90.0, -1e-3], [-300.0, 0.0, -5.0]])
    old = torch.tensor([[-40.0, -1.0, 0.0], [0.0, -100.0, -7.0]])
    loss, metrics = policy_loss(
        logp,
        behavior,
        torch.tensor([1.0, -1.0]),
        torch.ones(2, 3),
        objective=obj,
        correction=corr,
        anchor="decoupled",
        old_logp=old,
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v).all() for v in metrics.values())


def test_behaviour_weights_carry_no_gradient():
    old = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    w, _ = call(C.TokenIS(), old - torch.zeros(1, 2), torch.ones(1, 2))
    assert not w.requires_grad


def test_cispo_keeps_gradient_on_clipped_tokens_ppo_does_not():
    anchor = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    adv = torch.tensor([1.0])
    for fn, expect_zero in [(ppo_clip, True), (cispo, False)]:
        logp = torch.tensor([[math.log(2.0), 0.0]], requires_grad=True)  # ratio 2 (clipped), 1
        per_token, _ = fn(logp, anchor, adv, mask)
        per_token.sum().backward()
        assert (logp.grad[0, 0] == 0) == expect_zero
    logp = torch.tensor([[math.log(2.0), 0.0]], requires_grad=True)
    per_token, _ = cispo(logp, anchor, adv, mask)
    per_token.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.2, -1.0]]))  # -sg(clip(r)) * A


def test_dual_clip_bounds_negative_advantage_loss():
    logp = torch.tensor([[math.log(10.0)]], requires_grad=True)  # ratio 10, A = -1
    per_token, _ = ppo_clip(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), dual_clip=3.0)
    assert per_token.item() == pytest.approx(3.0)
    per_token.sum().backward()
    assert logp.grad.item() == 0.0
    plain, _ = ppo_clip(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1))
    assert plain.item() == pytest.approx(10.0)


def test_gspo_clips_the_sequence_ratio():
    # token log-ratios 0.1 and -0.05: sequence ratio exp(0.025) > 1 + 4e-4, A > 0 -> clipped
    logp = torch.tensor([[0.1, -0.05]], requires_grad=True)
    per_token, m = gspo(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
    assert per_token[0, 0].item() == pytest.approx(-(1 + 4e-4))
    assert m["clip_frac"].item() == 1.0
    per_token.sum().backward()
    assert (logp.grad == 0).all()


def test_gmpo_geometric_mean_with_log_space_clip():
    logp = torch.tensor([[0.2, 1.0]], requires_grad=True)  # log ratios 0.2, 1.0 (clipped to 0.4 for A>0)
    per_token, _ = gmpo(logp, torch.zeros(1, 2), torch.tensor([2.0]), torch.ones(1, 2), eps=0.4)
    assert per_token[0, 0].item() == pytest.approx(-2.0 * math.exp((0.2 + 0.4) / 2), rel=1e-6)


def test_reinforce_gradient_is_ratio_weighted():
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    per_token, _ = reinforce(logp, torch.tensor([[math.log(0.25)]]), torch.tensor([3.0]), torch.ones(1, 1))
    per_token.sum().backward()
    assert logp.grad.item() == pytest.approx(-6.0)  # -sg(r=2) * A


def test_aggregations_hand_values():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(per_token, mask, "seq_mean_token_mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(per_token, mask, "seq_mean_token_sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(per_token, mask, "seq_mean_token_sum_norm", 5).item() == pytest.approx(10 / (2 * 5))
    with pytest.raises(ValueError, match="algo.loss.aggregation"):
        aggregate(per_token, mask, "sum")


def test_kl_estimators():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    log_rho = ref - logp  # -0.5, 1.0
    assert torch.allclose(kl_penalty(logp, ref, "k1"), -log_rho)
    assert torch.allclose(kl_penalty(logp, ref, "k2"), 0.5 * log_rho**2)
    assert torch.allclose(kl_penalty(logp, ref, "k3"), log_rho.exp() - 1 - log_rho)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert kl_penalty(logp, logp, "k3").abs().max() == 0


def test_decoupled_anchor_uses_pi_old_and_behaviour_weight():
    # pi_old = mu + log 2 on every token, pi = pi_old: ratio 1, behaviour weight 2 (token IS)
    mu = torch.full((1, 2), -1.0)
    old = mu + math.log(2.0)
    logp = old.clone().requires_grad_(True)
    loss, m = policy_loss(
        logp,
        mu,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        correction=C.TokenIS(),
        anchor="decoupled",
        old_logp=old,
    )
    assert loss.item() == pytest.approx(-2.0)
    assert m["mismatch/k1"].item() == pytest.approx(-math.log(2.0))
    with pytest.raises(ValueError, match="decoupled"):
        policy_loss(logp, mu, torch.tensor([1.0]), torch.ones(1, 2), anchor="decoupled")


def test_limit_caps_the_final_weight_of_any_correction():
    torch.manual_seed(0)
    log_w = torch.randn(4, 6)
    mask = torch.ones_like(log_w)
    capped = C.TokenIS()
    capped.limit = 1.5
    assert torch.equal(capped(log_w, mask)[0], C.TruncatedTokenIS(cap=1.5)(log_w, mask)[0])
    seq = C.SequenceIS()
    seq.limit = 2.0
    w = seq(log_w, mask)[0]
    assert float(w.max()) <= 2.0 and torch.equal(w, C.SequenceIS(cap=2.0)(log_w, mask)[0])
