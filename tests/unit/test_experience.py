from __future__ import annotations

import pytest
import torch

from data.rollout.experience import Experience, collate


def make(prompt, response, lps, version=3, spans=None, mask=None):
    return Experience(
        prompt_id=0,
        group_id=0,
        sample_index=0,
        prompt_ids=prompt,
        response_ids=response,
        behavior_logprobs=lps,
        reward=1.0,
        policy_version=version,
        sampling={"temperature": 1.0},
        gen_start=0.0,
        gen_end=1.0,
        truncated=False,
        advantage=0.5,
        version_spans=spans or [],
        loss_mask=mask,
    )


def test_collate_aligns_response_tokens_with_targets():
    a = make([10, 11, 12], [20, 21], [-0.1, -0.2])
    b = make([10], [30, 31, 32], [-1.0, -2.0, -3.0], version=2, mask=[1, 0, 1])
    t = collate([a, b], pad_id=0)
    assert t["input_ids"].tolist() == [[10, 11, 12, 20, 21], [10, 30, 31, 32, 0]]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # target t is input_ids[:, t+1]; response of a starts at target index 2
    assert t["loss_mask"].tolist() == [[0, 0, 1, 1], [1, 0, 1, 0]]
    assert torch.allclose(t["behavior_logprobs"], torch.tensor([[0, 0, -0.1, -0.2], [-1.0, -2.0, -3.0, 0]]))
    targets = t["input_ids"][:, 1:]
    assert targets[0, 2:].tolist() == [20, 21] and targets[1, :3].tolist() == [30, 31, 32]
    assert t["policy_versions"].tolist() == [3, 2]
    assert t["advantages"].tolist() == [0.5, 0.5]


def test_version_spans_give_per_token_versions():
    e = make([1], [5, 6, 7, 8], [0.0] * 4, version=4, spans=[(4, 0, 2), (5, 2, 4)])
    assert e.token_versions() == [4, 4, 5, 5]
    t = collate([e], pad_id=0)
    assert t["token_versions"][0].tolist() == [4, 4, 5, 5]


def test_mismatched_logprobs_are_rejected():
    with pytest.raises(ValueError, match="behavior_logprobs"):
        make([1], [5, 6], [0.0])
