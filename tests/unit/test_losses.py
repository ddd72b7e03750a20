"""PPO-clip against hand-computed values and gradients."""

from __future__ import annotations

import math

import torch

from modules.algo.losses import ppo_clip_loss


def _inputs(ratios, behavior=-1.0):
    b = torch.full((1, len(ratios)), behavior)
    logp = (b + torch.log(torch.tensor([ratios]))).requires_grad_(True)
    return logp, b


def test_on_policy_value_and_gradient():
    # ratio 1 everywhere: loss = -mean(A), d loss / d logp_t = -A / n_tokens
    logp, b = _inputs([1.0, 1.0, 1.0])
    mask = torch.ones(1, 3)
    loss, m = ppo_clip_loss(logp, b, torch.tensor([2.0]), mask)
    loss.backward()
    assert math.isclose(loss.item(), -2.0, rel_tol=1e-6)
    assert torch.allclose(logp.grad, torch.full((1, 3), -2.0 / 3))
    assert m["clip_frac"].item() == 0.0 and abs(m["kl_behavior"].item()) < 1e-7


def test_clipping_positive_advantage():
    # A = 1; ratios 1.5 (clipped at 1.2, no grad), 0.5 (unclipped: min picks r*A), 1.1
    logp, b = _inputs([1.5, 0.5, 1.1])
    loss, m = ppo_clip_loss(logp, b, torch.tensor([1.0]), torch.ones(1, 3), 0.2, 0.2)
    loss.backward()
    assert math.isclose(loss.item(), -(1.2 + 0.5 + 1.1) / 3, rel_tol=1e-6)
    # grad of -r*A/3 wrt logp is -r/3 where unclipped, 0 where clipped
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5 / 3, -1.1 / 3]]), atol=1e-6)
    assert math.isclose(m["clip_frac"].item(), 1 / 3, rel_tol=1e-6)


def test_clipping_negative_advantage_and_asymmetric_eps():
    # A = -1, eps_low 0.2, eps_high 0.28: ratio 0.5 clipped at 0.8 (no grad); 1.5 unclipped
    logp, b = _inputs([0.5, 1.5])
    loss, m = ppo_clip_loss(logp, b, torch.tensor([-1.0]), torch.ones(1, 2), 0.2, 0.28)
    loss.backward()
    assert math.isclose(loss.item(), (0.8 + 1.5) / 2, rel_tol=1e-6)
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 1.5 / 2]]), atol=1e-6)
    assert math.isclose(m["clip_frac"].item(), 0.5, rel_tol=1e-6)


def test_mask_and_token_mean_over_batch():
    # two sequences, 3 and 1 trained tokens: token-mean weights every token equally
    logp = torch.zeros(2, 3, requires_grad=True)
    b = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    loss, _ = ppo_clip_loss(logp, b, torch.tensor([1.0, -3.0]), mask)
    loss.backward()
    assert math.isclose(loss.item(), -(3 * 1.0 - 3.0) / 4, abs_tol=1e-7)
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25, -0.25], [0.0, 0.75, 0.0]]))


def test_behavior_logprobs_get_no_gradient_and_extremes_are_finite():
    logp = torch.tensor([[0.0, -50.0]], requires_grad=True)
    b = torch.tensor([[-60.0, 0.0]], requires_grad=True)
    loss, m = ppo_clip_loss(logp, b, torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    assert b.grad is None or (b.grad == 0).all()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in m.values())


def _grad(**kwargs) -> torch.Tensor:
    """d loss / d logp of ``policy_loss`` on one fixed off-policy batch (pi far from mu)."""
    from modules.algo.losses import policy_loss

    g = torch.Generator().manual_seed(0)
    mu = -1.0 - torch.rand(3, 5, generator=g)
    pi_old = mu + 0.3 * torch.randn(3, 5, generator=g)  # a stale behaviour policy
    logp = (pi_old + 0.4 * torch.randn(3, 5, generator=g)).requires_grad_(True)  # moved past the clip
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    old = pi_old if kwargs.get("anchor") == "decoupled" else None  # bypass: pi_old := mu
    loss, metrics = policy_loss(logp, mu, torch.tensor([1.0, -0.5, 2.0]), mask, old_logp=old, **kwargs)
    loss.backward()
    return logp.grad, metrics


def test_bypass_without_clip_is_the_unclipped_surrogate_and_untruncated_decoupled_token_is():
    """The clip-free bypass arm (``algo/objective=reinforce``, bypass anchor): the gradient of
    PPO's surrogate r A with r = pi / mu and no clip, which is also decoupled PPO with an
    untruncated token IS weight pi_old / mu and no clip; the clipped bypass differs (its
    trust region binds here)."""
    import functools

    from modules.algo.corrections import TokenIS
    from modules.algo.losses import ppo_clip, reinforce

    noclip, _ = _grad(objective=reinforce, anchor="bypass")
    surrogate, _ = _grad(objective=functools.partial(ppo_clip, eps_low=1.0, eps_high=1e9), anchor="bypass")
    decoupled, _ = _grad(objective=reinforce, anchor="decoupled", correction=TokenIS(self_normalize=False))
    clipped, m = _grad(objective=ppo_clip, anchor="bypass")
    assert torch.allclose(noclip, surrogate, atol=1e-6) and torch.allclose(noclip, decoupled, atol=1e-6)
    assert m["clip_frac"] > 0 and not torch.allclose(noclip, clipped, atol=1e-3)


def test_ratio_statistics_of_both_anchors():
    """``ratio/mu_*`` and ``ratio/pi_old_*``: pi / mu and pi / pi_old over the masked tokens."""
    from modules.algo.losses import policy_loss

    mu = torch.full((1, 4), -1.0)
    pi_old = mu + torch.log(torch.tensor([[1.0, 1.0, 2.0, 1.0]]))
    logp = mu + torch.log(torch.tensor([[1.1, 0.5, 2.0, 9.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the 9x token is masked out
    _, m = policy_loss(logp, mu, torch.tensor([1.0]), mask, anchor="decoupled", old_logp=pi_old)
    assert math.isclose(m["ratio/mu_mean"].item(), (1.1 + 0.5 + 2.0) / 3, rel_tol=1e-5)
    assert math.isclose(m["ratio/mu_max"].item(), 2.0, rel_tol=1e-5)
    assert math.isclose(m["ratio/mu_min"].item(), 0.5, rel_tol=1e-5)
    assert math.isclose(m["ratio/mu_out_frac"].item(), 2 / 3, rel_tol=1e-5)  # 0.5 and 2.0
    assert math.isclose(m["ratio/pi_old_mean"].item(), (1.1 + 0.5 + 1.0) / 3, rel_tol=1e-5)
    assert math.isclose(m["ratio/pi_old_out_frac"].item(), 1 / 3, rel_tol=1e-5)  # 0.5 only
    _, b = policy_loss(logp, mu, torch.tensor([1.0]), mask)  # bypass: pi_old is mu
    assert b["ratio/pi_old_mean"] == b["ratio/mu_mean"]
