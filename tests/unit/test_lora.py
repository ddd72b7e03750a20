"""LoRA on the policy (modules/policy/lora.py): the merged weights the engine is sent, what trains,
the adapter-off reference, start-up errors, and engine-vs-trainer equality after a sync."""

from __future__ import annotations

import copy

import pytest
import torch
from hydra.utils import instantiate

from modules.config.errors import ConfigError
from modules.launch.validate import validate
from modules.policy.hf_policy import build_policy, named_weights, token_logprobs
from modules.policy.lora import LoRA, adapters_off, is_lora, merged_weights
from tests.conftest import compose
from tests.unit.test_loss_selection import synthetic_batch


def _lora_policy(path, rank=4, seed=0, **kw):
    """A LoRA policy whose B matrices are random (a trained adapter, not the zero init)."""
    policy, _ = build_policy(path, lora=LoRA(rank=rank, **kw))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return policy


@pytest.mark.parametrize("kw", [{}, {"rslora": True, "alpha": 8}])
def test_merged_weights_are_peft_merge_and_unload_under_hf_names(models, kw):
    policy = _lora_policy(models["tied"], rank=4, **kw)
    merged = named_weights(policy)
    reference = copy.deepcopy(policy).merge_and_unload()
    expected = named_weights(reference)  # a plain HF model now
    assert set(merged) == set(expected)
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    assert "lm_head.weight" not in merged  # tied: vLLM ties it itself
    for key, tensor in expected.items():
        torch.testing.assert_close(merged[key], tensor, rtol=0, atol=1e-6)
    # every adapted projection changed, the rest (embeddings, norms) is the base exactly
    base = named_weights(build_policy(models["tied"])[0])
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed)
    assert {k for k in base if k.endswith("proj.weight")} == changed  # all-linear: every one


def test_merged_model_scores_like_the_adapted_policy(models):
    """The engine serves the merged weights: a plain HF model loaded with them must give the
    LoRA policy's logprobs (what the weight-sync check compares after every sync)."""
    policy = _lora_policy(models["untied"], rank=8, alpha=16, seed=3)
    plain, _ = build_policy(models["untied"])
    plain.load_state_dict(named_weights(policy))
    batch = synthetic_batch()
    args = (batch["input_ids"], batch["attention_mask"], 1.0)
    with torch.no_grad():
        a, _ = token_logprobs(policy, *args)
        b, _ = token_logprobs(plain, *args)
        with adapters_off(policy):  # the base again
            c, _ = token_logprobs(policy, *args)
        d, _ = token_logprobs(build_policy(models["untied"])[0], *args)
    mask = batch["attention_mask"][:, 1:] > 0
    assert (a - b)[mask].abs().max() < 1e-4  # float32: (W + sBA)x vs Wx + sB(Ax)
    assert (a - c)[mask].abs().max() > 1e-3  # the adapter does change the policy
    assert (c - d)[mask].abs().max() == 0  # adapters off is the base exactly


def test_only_the_adapters_train_and_step_zero_is_the_warm_start(models):
    cfg = compose(
        [f"model.path={models['tied']}", "model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]"]
    )
    module = instantiate(cfg.module)
    module.configure_model()
    assert is_lora(module.policy)
    base = named_weights(build_policy(models["tied"])[0])
    start = named_weights(module.policy)
    assert all(torch.equal(base[k], start[k]) for k in base)  # B = 0: merged == warm start
    opt = module.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt
    trained = [p for g in opt.param_groups for p in g["params"]]
    names = {id(p): n for n, p in module.policy.named_parameters()}
    assert trained and all("lora_" in names[id(p)] for p in trained)
    assert {names[id(p)].split(".lora_")[0].rsplit(".", 1)[-1] for p in trained} == {"q_proj", "v_proj"}
    frozen = {n: p.detach().clone() for n, p in module.policy.named_parameters() if not p.requires_grad}
    loss = module.training_step(iter([([synthetic_batch()], 0, 0)]))
    loss.backward()
    opt.step()
    after = dict(module.policy.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in frozen.items())
    moved = named_weights(module.policy)
    changed = {k for k in base if not torch.equal(base[k], moved[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed)


def test_the_reference_is_the_policy_with_adapters_off(models):
    """LoRA with the reference at the warm start: no second model; its logprobs are the
    base's, while the policy's own have moved."""
    cfg = compose([f"model.path={models['tied']}", "model.lora.rank=4", "algo.loss.kl_coef=0.1"])
    module = instantiate(cfg.module)
    module.configure_model()
    assert module.ref_policy is None
    _perturb_adapters(module.policy)
    batch = synthetic_batch()
    ref = module.ref_logprobs(batch)
    with torch.no_grad():
        base, _ = token_logprobs(
            build_policy(models["tied"])[0], batch["input_ids"], batch["attention_mask"], 1.0
        )
        now, _ = token_logprobs(module.policy, batch["input_ids"], batch["attention_mask"], 1.0)
    mask = batch["attention_mask"][:, 1:] > 0
    assert (ref - base)[mask].abs().max() < 1e-6
    assert (now - base)[mask].abs().max() > 1e-3
    # another reference path still loads a separate frozen model
    cfg = compose(
        [f"model.path={models['tied']}", "model.lora.rank=4", f"module.ref_model_path={models['untied']}"]
    )
    module = instantiate(cfg.module)
    module.configure_model()
    assert module.ref_policy is not None and not is_lora(module.ref_policy)


def _perturb_adapters(policy):
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)


def test_rank_zero_is_full_fine_tuning(models):
    module = instantiate(compose([f"model.path={models['tied']}"]).module)
    module.configure_model()
    assert not is_lora(module.policy) and all(p.requires_grad for p in module.policy.parameters())


def test_scaling_and_rslora():
    assert LoRA(rank=8, alpha=16).scaling == 2.0
    assert LoRA(rank=16, alpha=16, rslora=True).scaling == 4.0


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.lora.rank=-1", "model.lora.rank"),
        ("model.lora.rank=2.5", "model.lora.rank"),
        ("model.lora.alpha=0", "model.lora.alpha"),
        ("model.lora.target_modules=[]", "model.lora.target_modules"),
        ("model.lora.target_modules=[q_proj,attn_out]", "model.lora.target_modules"),
        ("model.lora.rslora=maybe", "model.lora.rslora"),
        ("trainer=fsdp_cpu", "model.lora.rank"),
        ("recipe=sft_warmup", "model.lora.rank"),  # SFT trains every weight: not ignored silently
        ("+model.lora.dropout=0.1", "model.lora"),  # RL needs dropout off; unknown fields named
        ("~model.lora._target_", "model.lora._target_"),
        ("model.lora.target_modules=[lm_head]", "model.lora.target_modules"),  # tied: never sent
    ],
)
def test_bad_lora_settings_name_the_field_at_start_up(models, override, field):
    cfg = compose([f"model.path={models['tied']}", "model.lora.rank=4", override])
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as err:
        validate(cfg)
    if "attn_out" in override:  # names the model's own layers
        assert "attn_out not found" in str(err.value) and "q_proj" in str(err.value)


def test_merged_weights_leave_the_model_unchanged(models):
    policy = _lora_policy(models["tied"])
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    merged_weights(policy)
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())


def test_names_are_checked_when_the_adapters_are_built_too(models):
    """A hub model has no local config at start-up: the same check runs on the loaded model
    (peft alone would adapt the names that match and skip a typo silently)."""
    policy, _ = build_policy(models["tied"])
    with pytest.raises(ConfigError, match="v_prj not found"):
        LoRA(rank=4, target_modules=["q_proj", "v_prj"]).wrap(policy)


@pytest.mark.parametrize(
    "saved, now, field",
    [
        (
            {"rank": 8, "alpha": 32.0, "target_modules": "all-linear", "rslora": False},
            dict(rank=8, alpha=16),
            "alpha",
        ),
        (
            {"rank": 8, "alpha": 32.0, "target_modules": "all-linear", "rslora": False},
            dict(rank=8, rslora=True),
            "rslora",
        ),
        ({"rank": 8, "alpha": 32.0, "target_modules": "all-linear", "rslora": False}, dict(rank=4), "rank"),
        (None, dict(rank=8), "rank"),  # a full fine-tuning checkpoint
        ({"rank": 8, "alpha": 32.0, "target_modules": "all-linear", "rslora": False}, dict(rank=0), "rank"),
    ],
)
def test_resume_refuses_other_lora_settings_naming_the_field(saved, now, field):
    from modules.policy.lora import check_resume

    with pytest.raises(ConfigError, match=rf"model\.lora\.{field}"):
        check_resume(saved, LoRA(**now))
    check_resume(LoRA(**now).spec() if now["rank"] else None, LoRA(**now))  # the same: resumes


def test_a_checkpoint_resumes_with_the_same_lora_and_refuses_another_alpha(models, tmp_path):
    cfg = compose([f"model.path={models['tied']}", "model.lora.rank=4"])
    module = instantiate(cfg.module)
    module.configure_model()
    _perturb_adapters(module.policy)
    ckpt = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(ckpt)
    resumed = instantiate(cfg.module)
    resumed.on_load_checkpoint(ckpt)  # what Lightning calls before loading the state dict
    resumed.load_state_dict(ckpt["state_dict"])
    a, b = named_weights(module.policy), named_weights(resumed.policy)
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = instantiate(
        compose([f"model.path={models['tied']}", "model.lora.rank=4", "model.lora.alpha=8"]).module
    )
    with pytest.raises(ConfigError, match=r"model\.lora\.alpha"):
        other.on_load_checkpoint(ckpt)
