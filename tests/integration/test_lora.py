"""LoRA on the policy (modules/policy/lora.py): the merged weights the engine is sent, what trains,
the adapter-off reference, start-up errors, and engine-vs-trainer equality after a sync."""

from __future__ import annotations

import torch

from modules.policy.hf_policy import build_policy, named_weights, token_logprobs
from modules.policy.lora import LoRA


def _lora_policy(path, rank=4, seed=0, **kw):
    """A LoRA policy whose B matrices are random (a trained adapter, not the zero init)."""
    policy, _ = build_policy(path, lora=LoRA(rank=rank, **kw))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return policy


def test_engine_serves_the_merged_lora_policy(engine, models):
    """Sync equality on the real engine: after pushing the merged weights of a LoRA policy
    with trained (nonzero) adapters, the engine's logprobs of a sequence equal the trainer's
    LoRA forward to kernel rounding (3e-4; a wrong or stale tensor moves them by > 1e-2)."""
    policy = _lora_policy(models["tied"], rank=8, seed=5)
    policy.eval()
    engine.update_weights(named_weights(policy), engine.version + 1)
    ids = [7, 10, 17, 5, 18, 19, 13, 37, 23, 5, 13, 6, 17, 34]
    got = torch.tensor(engine.score(ids))
    with torch.no_grad():
        want, _ = token_logprobs(policy, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), 1.0)
        base, _ = token_logprobs(
            build_policy(models["tied"])[0],
            torch.tensor([ids]),
            torch.ones(1, len(ids), dtype=torch.long),
            1.0,
        )
    assert (got - want[0, -len(got) :]).abs().max() < 3e-4  # vLLM-CPU vs torch kernels: ~1e-4
    assert (got - base[0, -len(got) :]).abs().max() > 1e-2  # not the base it started from
