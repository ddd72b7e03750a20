"""PPO's critic (modules/policy/critic.py): reward placement, clipped value loss, the step's
advantages and targets on a real tiny model, and that the critic learns."""

from __future__ import annotations

import pytest
import torch

from modules.algo.losses import PolicyLoss, ppo_clip
from modules.config.errors import ConfigError
from modules.policy.critic import Critic, explained_variance, terminal_rewards, value_loss


def test_terminal_rewards_sit_on_each_last_trained_token():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.float32)
    out = terminal_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert out.tolist() == [[0, 0, 2.0, 0], [0, 0, 0, -1.0], [0, 0, 0, 0]]


def test_value_loss_clips_around_the_old_value():
    v, old, tgt, m = (torch.tensor([[x]]) for x in (1.0, 0.0, 1.0, 1.0))
    assert value_loss(v, old, tgt, m, None).item() == 0.0
    # clipped value 0.2 is 0.8 from the target: the max of the two picks the clipped one
    assert value_loss(v, old, tgt, m, 0.2).item() == pytest.approx(0.5 * 0.8**2)
    assert value_loss(torch.tensor([[0.1]]), old, tgt, m, 0.2).item() == pytest.approx(0.5 * 0.9**2)


def test_explained_variance():
    m = torch.ones(1, 4)
    t = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    assert explained_variance(t, t, m).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(t, 1.5), t, m).item() == pytest.approx(0.0)


def test_bad_critic_settings_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="module.critic.lam"):
        Critic(str(tmp_path), lam=1.5)
    with pytest.raises(ConfigError, match="module.critic.clip"):
        Critic(str(tmp_path), clip=0.0)


@pytest.fixture(scope="module")
def batch(models):
    """Two responses to one prompt: rewards 1 and 0, 3 and 2 response tokens."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12, 0]])
    att = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    mask = torch.zeros(2, 5)
    mask[0, 2:5] = 1
    mask[1, 2:4] = 1
    return {
        "input_ids": ids,
        "attention_mask": att,
        "loss_mask": mask,
        "rewards": torch.tensor([1.0, 0.0]),
        "behavior_logprobs": torch.full((2, 5), -1.0) * mask,
        "group_ids": torch.tensor([0, 0]),
        "sample_indexes": torch.tensor([0, 1]),
    }


def test_a_fresh_critic_targets_the_return_and_advantages_are_whitened(models, batch):
    critic = Critic(str(models["tied"]), whiten_advantages=False)
    critic.build()
    logp = batch["behavior_logprobs"].clone()  # on-policy: ratio 1, V-trace = GAE
    adv, vloss, metrics = critic.step(batch, logp)
    mask = batch["loss_mask"]
    # zero-initialised head: V = 0, so with gamma = lam = 1 every token's advantage is R
    assert torch.equal(adv, torch.tensor([[1.0], [0.0]]) * mask)
    assert metrics["critic/target_mean"].item() == pytest.approx(3 / 5)
    assert vloss.sum().item() == pytest.approx(0.5 * 0.5 * 3)  # coef 0.5 x 0.5 x (1^2 x 3 tokens)
    critic = Critic(str(models["tied"]))
    critic.build()
    adv, _, _ = critic.step(batch, logp)
    real = adv[mask > 0]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert real.std().item() == pytest.approx(1.0, abs=1e-4)


def test_stale_tokens_get_truncated_targets(models, batch):
    critic = Critic(str(models["tied"]), whiten_advantages=False)
    critic.build()
    logp = batch["behavior_logprobs"].clone()
    logp[0, 4] -= 1.0  # the current policy is less likely than mu to end sample 0 this way
    adv, _, _ = critic.step(batch, logp)
    rho = torch.exp(torch.tensor(-1.0)).item()
    # the last token's own weight pi/mu comes from the objective's ratio, not the advantage
    assert adv[0, 4].item() == pytest.approx(1.0)
    # earlier tokens (ratio 1) bootstrap from v_{s+1} = V + c (v - V): the trace carries the
    # truncated return back, so they see rho x R (V = 0 here)
    assert adv[0, 2].item() == pytest.approx(rho) and adv[0, 3].item() == pytest.approx(rho)
    assert adv[1, 2:4].tolist() == [0.0, 0.0]


def test_old_values_survive_recollation_across_epochs(models, batch):
    """Epoch 2 re-collates minibatches to another width: V_old is kept per sample, unpadded."""
    critic = Critic(str(models["tied"]), whiten_advantages=False, clip=0.2)
    critic.build()
    critic.step(batch, batch["behavior_logprobs"])  # first sight: V_old = 0 (zero head)
    with torch.no_grad():
        critic.model.head.bias.fill_(1.0)  # the critic moved by 1
    wide = {k: v for k, v in batch.items()}
    for k in ("input_ids", "attention_mask"):
        wide[k] = torch.cat([batch[k], torch.zeros_like(batch[k][:, :2])], dim=1)
    for k in ("loss_mask", "behavior_logprobs"):
        wide[k] = torch.cat([batch[k], torch.zeros_like(batch[k][:, :2])], dim=1)
    _, vloss, _ = critic.step(wide, wide["behavior_logprobs"])
    # clipped to V_old + 0.2 = 0.2 where the unclipped 1.0 would be closer to target 1:
    # max((1 - 1)^2, (0.2 - 1)^2) on sample 0's tokens, max((1-0)^2, (0.2-0)^2) on sample 1's
    assert vloss[0, 2:5].tolist() == pytest.approx([0.5 * 0.5 * 0.64] * 3)
    assert vloss[1, 2:4].tolist() == pytest.approx([0.5 * 0.5 * 1.0] * 2)


def test_critic_refuses_the_kl_reward_and_sharding():
    from modules.launch.compose import build
    from modules.policy.sharding import validate_sharding
    from tests.conftest import compose

    with pytest.raises(ConfigError, match="algo.kl_reward.coef"):
        build(compose(["recipe=ppo", "algo.kl_reward.coef=0.05"]).module)
    with pytest.raises(ConfigError, match="module.critic"):
        validate_sharding(compose(["recipe=ppo", "trainer=fsdp_cpu"]))


def test_the_critic_learns_the_returns_and_the_policy_loss_takes_per_token_advantages(models, batch):
    from modules.policy.hf_policy import load_policy, token_logprobs

    critic = Critic(str(models["tied"]), lr=1e-3, clip=None)
    critic.build()
    opt = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    mask = batch["loss_mask"]
    losses = []
    for _ in range(30):
        critic.new_rollout_batch()
        _, vloss, metrics = critic.step(batch, batch["behavior_logprobs"])
        loss = vloss.sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # the first trained state (prompt 5 6 7) is shared, targets 1 and 0: the best value there is
    # 0.5, a floor of coef x 0.5 x (0.5^2 + 0.5^2) / 5 tokens = 0.025; the rest is learnable
    assert losses[0] == pytest.approx(0.15) and losses[-1] < 0.027
    assert metrics["critic/explained_var"].item() > 0.5
    policy, _ = load_policy(models["tied"])
    logp, _ = token_logprobs(policy, batch["input_ids"], batch["attention_mask"], 1.0)
    adv, _, _ = critic.step(batch, logp.detach())
    fn = PolicyLoss(objective=ppo_clip)
    loss, _ = fn(logp, logp.detach(), adv, mask)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
