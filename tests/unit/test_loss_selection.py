"""Every objective x correction is selectable from the config and trains without NaN.

Runs the real LightningModule's training step (no engine: a synthetic batch of sampled
tokens from the tiny model) for a few optimizer steps per combination.
"""

from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate

from data.rollout.experience import Experience, collate
from modules.policy.hf_policy import token_logprobs
from tests.conftest import ROOT, compose

CORRECTIONS = sorted(p.stem for p in (ROOT / "conf/algo/correction").glob("*.yaml"))

OBJECTIVES = sorted(p.stem for p in (ROOT / "conf/algo/objective").glob("*.yaml"))


def synthetic_batch(seed: int = 0) -> dict:
    exps = synthetic_exps(seed)
    batch = collate(exps, pad_id=0)
    batch["num_samples"] = len(exps)
    return batch


def synthetic_exps(seed: int = 0) -> list[Experience]:
    """Six responses of 3..8 tokens in two groups of three."""
    g = torch.Generator().manual_seed(seed)
    exps = []
    for i in range(6):
        n = 3 + i
        exps.append(
            Experience(
                prompt_id=i,
                group_id=i // 3,
                sample_index=i % 3,
                prompt_ids=[7, 10, 17, 8, 18],
                response_ids=torch.randint(3, 20, (n,), generator=g).tolist(),
                behavior_logprobs=(-torch.rand(n, generator=g) * 3).tolist(),
                reward=float(i % 2),
                policy_version=0,
                sampling={},
                gen_start=0.0,
                gen_end=1.0,
                truncated=False,
                advantage=float(i % 2) - 0.5,
                staleness=i % 3,
            )
        )
    return exps


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_every_method_trains_without_nan(models, objective, correction):
    anchor = "decoupled" if correction not in ("none", "ds_seq_mask", "lag") else "bypass"
    cfg = compose(
        [
            f"algo/objective={objective}",
            f"algo/correction={correction}",
            f"algo.loss.anchor={anchor}",
            f"model.path={models['tied']}",
        ]
    )
    module = instantiate(cfg.module)
    module.configure_model()
    opt = module.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt
    batch = synthetic_batch()
    if module.needs_old_logprobs:
        batch["old_logprobs"] = module.old_logprobs(batch)
    for _ in range(3):
        logp, _ = token_logprobs(
            module.policy, batch["input_ids"], batch["attention_mask"], module.temperature
        )
        extra = {"old_logp": batch["old_logprobs"]} if "old_logprobs" in batch else {}
        loss, metrics = module.loss_fn(
            logp,
            batch["behavior_logprobs"],
            batch["advantages"],
            batch["loss_mask"],
            weights=batch["weights"],
            staleness=batch["staleness"],
            **extra,
        )
        assert math.isfinite(loss.item())
        assert all(torch.isfinite(v).all() for v in metrics.values())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())


def test_kl_to_reference_needs_a_reference_model(models):
    with pytest.raises(Exception, match="module.ref_model_path"):
        instantiate(
            compose(
                ["algo.loss.kl_coef=0.1", f"model.path={models['tied']}", "module.ref_model_path=null"]
            ).module
        )
    module = instantiate(
        compose(
            [
                "algo.loss.kl_coef=0.1",
                f"model.path={models['tied']}",
                f"module.ref_model_path={models['tied']}",
            ]
        ).module
    )
    module.configure_model()
    assert module.ref_policy is not None and not any(p.requires_grad for p in module.ref_policy.parameters())


def test_non_finite_steps_are_skipped_then_stop_the_run(models):
    from modules.policy.policy_gradient import NonFiniteLossError

    module = instantiate(compose([f"model.path={models['tied']}", "module.max_consecutive_skips=2"]).module)
    module.configure_model()
    good = synthetic_batch()
    bad = synthetic_batch()
    bad["behavior_logprobs"][0, 5] = float("nan")

    def step(batch):
        return module.training_step(iter([([batch], 0, 0)]))  # one rollout batch of one step

    assert step(bad) is None and module.skipped_steps == 1  # skipped, run continues
    assert torch.isfinite(step(good))  # a good step resets the streak
    assert step(bad) is None
    with pytest.raises(NonFiniteLossError, match="2 consecutive steps"):
        step(bad)
