"""Statistical checks of the off-policy estimators on the exact-gradient problem.

For H <= 12 the harness takes the exact expectation over the behaviour policy (all 2^H
sequences), so these are deterministic, not sampled, and fast.
"""

from __future__ import annotations

import pytest
import torch

from lab.exact_gradient import ESTIMATORS, exact_grad, measure, objective


def test_dp_objective_matches_enumeration():
    import itertools

    theta = torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64)
    p = torch.sigmoid(theta)
    brute = 0.0
    for y in itertools.product([0, 1], repeat=4):
        prob = torch.prod(torch.where(torch.tensor(y) == 1, p, 1 - p))
        brute += prob.item() * (sum(y) >= 2)
    assert objective(theta, 2).item() == pytest.approx(brute, abs=1e-12)
    _, g = exact_grad(theta, 2)
    assert g.shape == (4,) and torch.isfinite(g).all()


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_on_policy_estimators_are_unbiased(name):
    assert measure(6, 0, name, n_var=4)["bias"] < 1e-9


@pytest.mark.parametrize("lag", [1, 4])
def test_sequence_is_is_unbiased_off_policy(lag):
    assert measure(8, lag, "seq_is", n_var=4)["bias"] < 1e-9


def test_token_is_is_biased_off_policy_and_bias_grows_with_horizon():
    short = measure(4, 4, "token_is", n_var=4)["bias"]
    long = measure(12, 4, "token_is", n_var=4)["bias"]
    assert short > 0.05
    assert long > short
    assert measure(8, 1, "token_is", n_var=4)["bias"] < measure(8, 4, "token_is", n_var=4)["bias"]


def test_uncorrected_is_more_biased_than_token_is():
    assert measure(8, 4, "none", n_var=4)["bias"] > measure(8, 4, "token_is", n_var=4)["bias"]
