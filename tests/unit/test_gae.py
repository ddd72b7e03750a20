"""GAE, V-trace and whitening (modules/algo/gae.py) against hand values and exact expectations."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from modules.algo.gae import gae, vtrace, whiten


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_gae_hand_values():
    adv, ret = gae(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), gamma=0.9, lam=0.8)
    # delta = [0.9*0.6-0.5, 0.9*0.7-0.6, 1-0.7] = [0.04, 0.03, 0.3]; A_t = delta_t + 0.72 A_{t+1}
    a2 = 0.3
    a1 = 0.03 + 0.72 * a2
    a0 = 0.04 + 0.72 * a1
    assert adv.tolist()[0] == pytest.approx([a0, a1, a2])
    assert ret.tolist()[0] == pytest.approx([a0 + 0.5, a1 + 0.6, a2 + 0.7])


def test_gae_at_gamma_lambda_one_is_return_minus_value():
    values = t([[0.2, 0.4, 0.9, 0.0]])
    mask = t([[1, 1, 1, 0]])  # 3 real tokens, one pad
    rewards = t([[0, 0, 1.0, 0]])
    adv, ret = gae(rewards, values, mask)
    assert adv.tolist()[0] == pytest.approx([0.8, 0.6, 0.1, 0.0])
    assert ret.tolist()[0] == pytest.approx([1.0, 1.0, 1.0, 0.0])


def test_gae_padding_is_terminal_and_zero():
    values = t([[0.3, 0.5, 7.0]])  # a value on the pad must not be bootstrapped from
    adv, ret = gae(t([[0, 2.0, 0]]), values, t([[1, 1, 0]]), gamma=0.5, lam=0.5)
    assert adv[0, 2] == 0 and ret[0, 2] == 0
    assert adv[0, 1].item() == pytest.approx(2.0 - 0.5)  # no V beyond the last real token


def test_gae_matches_the_definition_on_random_rows():
    g = torch.Generator().manual_seed(0)
    b, n, gamma, lam = 4, 7, 0.95, 0.9
    rewards, values = (
        torch.randn(b, n, generator=g, dtype=torch.float64),
        torch.randn(b, n, generator=g, dtype=torch.float64),
    )
    lengths = [7, 5, 1, 3]
    mask = t([[1] * k + [0] * (n - k) for k in lengths])
    adv, _ = gae(rewards, values, mask, gamma, lam)
    for i, k in enumerate(lengths):
        v = values[i, :k].tolist() + [0.0]
        delta = [rewards[i, s].item() + gamma * v[s + 1] - v[s] for s in range(k)]
        want = [sum((gamma * lam) ** j * delta[s + j] for j in range(k - s)) for s in range(k)]
        assert adv[i, :k].tolist() == pytest.approx(want)
        assert adv[i, k:].abs().sum() == 0


def test_vtrace_on_policy_targets_are_lambda_returns():
    g = torch.Generator().manual_seed(1)
    rewards, values = (
        torch.randn(3, 6, generator=g, dtype=torch.float64),
        torch.randn(3, 6, generator=g, dtype=torch.float64),
    )
    mask = t([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4])
    for lam in (1.0, 0.8):
        adv_g, ret_g = gae(rewards, values, mask, 0.9, lam)
        adv_v, ret_v = vtrace(rewards, values, torch.zeros_like(values), mask, 0.9, lam)
        assert torch.allclose(ret_v, ret_g)
        if lam == 1.0:
            assert torch.allclose(adv_v, adv_g)


def test_vtrace_hand_values_with_truncation():
    # two tokens, pi/mu = [2.0, 0.5]: rho = [1, 0.5], c = lam * [1, 0.5]
    rewards, values = t([[0.0, 1.0]]), t([[0.4, 0.6]])
    log_ratio = torch.log(t([[2.0, 0.5]]))
    adv, v = vtrace(rewards, values, log_ratio, t([[1, 1]]), gamma=1.0, lam=1.0)
    d1 = 0.5 * (1.0 - 0.6)  # rho_1 delta_1
    d0 = 1.0 * (0.0 + 0.6 - 0.4)
    v1 = 0.6 + d1
    v0 = 0.4 + d0 + 1.0 * 1.0 * d1  # c_0 = min(1, 2) = 1
    assert v.tolist()[0] == pytest.approx([v0, v1])
    assert adv.tolist()[0] == pytest.approx([1.0 * (0.0 + v1 - 0.4), 0.5 * (1.0 - 0.6)])


def test_untruncated_vtrace_is_unbiased_for_the_target_policy_exactly():
    """Two binary tokens sampled by mu; E_mu[v_0] equals V^pi at the start, by enumeration,
    for any critic (the critic only moves variance) when rho_bar = c_bar = inf and lam = 1."""
    pi0, mu0 = 0.7, 0.4  # P(a0 = 1)
    pi1 = {0: 0.2, 1: 0.9}  # P(a1 = 1 | a0)
    mu1 = {0: 0.5, 1: 0.3}
    reward = {(0, 0): 0.0, (0, 1): 1.0, (1, 0): 0.3, (1, 1): 2.0}
    critic0, critic1 = 0.25, {0: -0.4, 1: 1.3}
    p = lambda q, a: q if a else 1 - q  # noqa: E731
    v_pi = sum(
        p(pi0, a0) * p(pi1[a0], a1) * reward[(a0, a1)] for a0, a1 in itertools.product((0, 1), repeat=2)
    )
    expect = 0.0
    for a0, a1 in itertools.product((0, 1), repeat=2):
        prob_mu = p(mu0, a0) * p(mu1[a0], a1)
        log_ratio = t([[math.log(p(pi0, a0) / p(mu0, a0)), math.log(p(pi1[a0], a1) / p(mu1[a0], a1))]])
        _, v = vtrace(
            t([[0.0, reward[(a0, a1)]]]),
            t([[critic0, critic1[a0]]]),
            log_ratio,
            t([[1, 1]]),
            rho_bar=math.inf,
            c_bar=math.inf,
        )
        expect += prob_mu * v[0, 0].item()
    assert expect == pytest.approx(v_pi, abs=1e-12)
    # truncated at 1 it is biased here (pi puts more mass where mu puts less): the test can fail
    trunc = 0.0
    for a0, a1 in itertools.product((0, 1), repeat=2):
        log_ratio = t([[math.log(p(pi0, a0) / p(mu0, a0)), math.log(p(pi1[a0], a1) / p(mu1[a0], a1))]])
        _, v = vtrace(t([[0.0, reward[(a0, a1)]]]), t([[critic0, critic1[a0]]]), log_ratio, t([[1, 1]]))
        trunc += p(mu0, a0) * p(mu1[a0], a1) * v[0, 0].item()
    assert abs(trunc - v_pi) > 0.05


def test_whiten_over_real_tokens_and_with_global_sums():
    adv = t([[1.0, 2.0, 3.0, 99.0]])
    mask = t([[1, 1, 1, 0]])
    w = whiten(adv, mask)
    assert w[0, :3].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
    assert w[0, 3] == 0
    # a rank holding half the tokens whitens with the whole batch's sums
    sums = (6.0, 21.0, 91.0)  # tokens 1..6
    assert whiten(t([[1.0, 2.0, 3.0]]), t([[1, 1, 1]]), sums)[0, 0].item() == pytest.approx(
        (1 - 3.5) / torch.tensor([1.0, 2, 3, 4, 5, 6]).std().item(), rel=1e-6
    )


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
        gae(t([[0, 1]]), t([[0, 1, 2]]), t([[1, 1]]))


def test_vtrace_can_leave_rho_out_of_the_policy_advantage():
    rewards, values = t([[0.0, 1.0]]), t([[0.4, 0.6]])
    log_ratio = torch.log(t([[2.0, 0.5]]))
    adv_w, v_w = vtrace(rewards, values, log_ratio, t([[1, 1]]))
    adv, v = vtrace(rewards, values, log_ratio, t([[1, 1]]), rho_in_advantage=False)
    assert torch.equal(v, v_w)  # the targets are the same
    assert adv.tolist()[0] == pytest.approx([v[0, 1].item() - 0.4, 1.0 - 0.6])
    assert adv_w.tolist()[0] == pytest.approx([1.0 * adv[0, 0].item(), 0.5 * adv[0, 1].item()])


def test_episode_observations_are_skipped_not_read_as_the_end():
    """A multi-turn episode's row (model turn, observation tokens with mask 0, model turn,
    padding): GAE and V-trace equal their values on the model tokens alone, laid side by side
    (the next state after a turn is the next turn's first token), and are 0 off the mask."""
    from modules.algo.gae import gae, vtrace

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 1, 1, 0, 0]], dtype=torch.float32)
    values = torch.randn(2, 7, generator=g)
    rewards = torch.zeros(2, 7)
    rewards[0, 5], rewards[1, 4] = 1.0, 0.5  # the outcome on each episode's last model token
    log_ratio = 0.3 * torch.randn(2, 7, generator=g)
    for row in range(2):
        idx = mask[row].nonzero().squeeze(1)
        one = (rewards[row, idx][None], values[row, idx][None])
        ones = torch.ones(1, len(idx))
        for full, alone in [
            (
                gae(rewards[row : row + 1], values[row : row + 1], mask[row : row + 1], 0.9, 0.8),
                gae(*one, ones, 0.9, 0.8),
            ),
            (
                vtrace(
                    rewards[row : row + 1],
                    values[row : row + 1],
                    log_ratio[row : row + 1],
                    mask[row : row + 1],
                    0.9,
                    0.8,
                ),
                vtrace(*one, log_ratio[row, idx][None], ones, 0.9, 0.8),
            ),
        ]:
            for f, a in zip(full, alone):
                assert torch.allclose(f[0, idx], a[0], atol=1e-6)
                assert torch.all(f[0, mask[row] == 0] == 0)
    both = gae(rewards, values, mask, 0.9, 0.8)[0]  # rows of different shapes in one batch
    assert torch.allclose(both[1], gae(rewards[1:], values[1:], mask[1:], 0.9, 0.8)[0][0])
