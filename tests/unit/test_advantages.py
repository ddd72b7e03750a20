from __future__ import annotations

import math

import torch

from modules.algo.advantages import GroupAdvantage, group_advantages


def test_grpo_advantage_hand_values():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    adv = group_advantages(r, eps=0.0)
    # mean 0.5, population std 0.5
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0, -1.0, 1.0]]))
    r = torch.tensor([[3.0, 1.0, 2.0]])
    std = math.sqrt(2 / 3)
    assert torch.allclose(group_advantages(r, eps=0.0), torch.tensor([[1 / std, -1 / std, 0.0]]))


def test_dr_grpo_does_not_scale():
    r = torch.tensor([[3.0, 1.0, 2.0]])
    assert torch.allclose(group_advantages(r, scale_by_std=False), torch.tensor([[1.0, -1.0, 0.0]]))


def test_degenerate_groups_give_zero_not_nan():
    r = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    for scale in (True, False):
        adv = group_advantages(r, scale_by_std=scale)
        assert torch.isfinite(adv).all() and (adv == 0).all()
    assert GroupAdvantage()([0.5]) == [0.0]  # G = 1


def test_groups_are_independent():
    r = torch.tensor([[1.0, 0.0], [5.0, 5.0]])
    adv = group_advantages(r)
    assert adv[1].abs().sum() == 0 and adv[0, 0] > 0 > adv[0, 1]
