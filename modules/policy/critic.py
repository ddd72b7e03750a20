"""PPO's critic: a separate value model, per-token advantages from V-trace / GAE, value loss.

    python train.py recipe=ppo                      # sync PPO with a critic on the testbed
    python train.py recipe=ppo rollout=streaming    # the same critic on stale samples

Design (why it differs from a textbook PPO-RLHF critic):

* **A separate model**, not a head on the policy trunk: the warm start's trunk
  (``AutoModel``) plus a zero-initialised linear head, so the policy forward, the weight push
  and the engine stay untouched, and a value loss cannot pull on the policy's features.
  ``values[b, t]`` is read at input position t, the state before target token t + 1 is
  sampled (aligned with the loss mask and behaviour logprobs). It trains in the policy's
  optimizer as its own parameter group (``lr``); ``trainer.gradient_clip_val`` clips the joint
  norm. Checkpointed with the module; never sent to the engine.
* **Stale samples: V-trace** (``modules/algo/gae.py``). Advantages and value targets are computed
  at each optimizer step from the critic's values at that step and the ratio of the current
  policy to the behaviour policy, truncated at ``rho_bar`` / ``c_bar``. On-policy (sync, ratio
  1) V-trace *is* GAE with the same gamma and lambda (tested), so one path serves every rollout
  mode; for a sample K versions old the truncated ratios discount the part of the return the
  current policy would not have produced, instead of fitting the critic to the behaviour
  policy's returns. The seeds name V-trace for this; recomputing GAE with the current critic
  alone would still evaluate the behaviour policy.
* **Rewards** are the outcome reward (after any shaping) on each response's last token;
  ``gamma = lam = 1`` by default (one episode per response, as in PPO for LLMs). A multi-turn
  episode (``env=...``) is one response whose observation tokens are masked out: V-trace runs
  over its model tokens only, so the state after a turn is the next turn's first token, whose
  value reads the observation (``python train.py recipe=ppo env=calculator task=calculator``).
* **Whitening**: advantages to zero mean, unit variance over the global batch's tokens (sums
  all-reduced under DDP), then the policy objective takes them per token.
* **Value loss**: ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-clip) - R)^2)``, token-mean
  over the global batch, times ``coef``. ``V_old`` is the critic's value of the sample the
  first time an optimizer step sees it (cached per sample), so the clip bounds how far the
  critic moves over a rollout batch's later epochs (``algo.epochs`` > 1); with one epoch each
  sample is seen once and the clip does nothing.
* **The policy advantage carries no rho**: IMPALA's ``rho_s (r_s + gamma v_{s+1} - V_s)`` is
  the importance-weighted advantage for a plain policy gradient; PPO-clip's ratio pi / pi_old
  (pi / mu in the bypass anchor) and ``algo/correction`` already weight each token, so the
  advantage is ``r_s + gamma v_{s+1} - V_s`` and rho acts in the value targets only.
* **Not combined with**: ``algo.kl_reward`` (the critic reads the outcome reward; use the KL
  in the loss, ``algo.loss.kl_coef``) and the sharded strategy (start-up refuses both). The
  critic runs one padded forward per minibatch (``module.gradient_checkpointing`` applies to
  its trunk too; ``algo.micro_batch_size`` does not).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modules.algo.gae import vtrace, whiten
from modules.config.errors import check


class ValueModel(nn.Module):
    """Trunk of the warm start + a scalar head; ``forward`` gives ``[B, T-1]`` values."""

    def __init__(self, model_path: str) -> None:
        super().__init__()
        from transformers import AutoModel

        self.trunk = AutoModel.from_pretrained(model_path, torch_dtype=torch.float32)
        self.head = nn.Linear(self.trunk.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden[:, :-1]).squeeze(-1)


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T-1]``: each sequence's reward on its last trained token (0 elsewhere)."""
    out = torch.zeros_like(mask, dtype=torch.float32)
    idx = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, idx, torch.full_like(idx, -1)).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards[rows].float()
    return out


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
) -> torch.Tensor:
    """Per-token clipped value loss (summed later with the policy loss's normaliser)."""
    loss = (values - targets) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - targets) ** 2)
    return 0.5 * loss * mask


class Critic(nn.Module):
    """Holds the value model and the PPO-critic settings (``module.critic``)."""

    # inf truncates nothing (V-trace's untruncated return); config: `.inf` in YAML, `inf` on the
    # command line (module.critic.rho_bar=inf). Other fields must be finite (config/schema.py).
    accepts_infinite = ("rho_bar", "c_bar")

    def __init__(
        self,
        model_path: str,
        lr: float = 1e-4,
        coef: float = 0.5,
        gamma: float = 1.0,
        lam: float = 1.0,
        clip: float | None = 0.2,
        rho_bar: float = 1.0,
        c_bar: float = 1.0,
        whiten_advantages: bool = True,
    ) -> None:
        super().__init__()
        check("module.critic.gamma", gamma, 0 <= gamma <= 1, "a float in [0, 1]")
        check("module.critic.lam", lam, 0 <= lam <= 1, "a float in [0, 1]")
        check("module.critic.lr", lr, lr > 0, "a float > 0")
        check("module.critic.coef", coef, coef > 0, "a float > 0")
        check("module.critic.clip", clip, clip is None or clip > 0, "null or a float > 0")
        check("module.critic.rho_bar", rho_bar, rho_bar > 0, "a float > 0 (inf: untruncated)")
        check("module.critic.c_bar", c_bar, c_bar > 0, "a float > 0 (inf: untruncated)")
        self.model_path = str(model_path)
        self.lr, self.coef, self.gamma, self.lam, self.clip = lr, coef, gamma, lam, clip
        self.rho_bar, self.c_bar, self.whiten_advantages = rho_bar, c_bar, whiten_advantages
        self.model: ValueModel | None = None
        self._old: dict[tuple[int, int], torch.Tensor] = {}  # V_old per (group id, sample index)

    def build(self, gradient_checkpointing: bool = False) -> None:
        if self.model is None:
            from modules.policy.hf_policy import disable_dropout

            self.model = ValueModel(self.model_path)
            disable_dropout(self.model)
            if gradient_checkpointing:
                self.model.trunk.gradient_checkpointing_enable({"use_reentrant": False})

    def new_rollout_batch(self) -> None:
        self._old = {}

    def _old_values(self, batch: dict[str, Any], v: torch.Tensor) -> torch.Tensor:
        """V_old: each sample's values when an optimizer step first saw it in this rollout
        batch (unpadded, by sample: later epochs re-collate minibatches to other widths)."""
        old = v.clone()
        lengths = (batch["attention_mask"].sum(dim=1) - 1).clamp_min(0).tolist()
        keys = zip(batch["group_ids"].tolist(), batch["sample_indexes"].tolist())
        for i, (key, n) in enumerate(zip(keys, lengths)):
            n = min(int(n), v.shape[1])
            first = self._old.setdefault(key, v[i, :n].clone())
            old[i, : len(first)] = first
        return old

    def step(
        self, batch: dict[str, Any], logp: torch.Tensor, global_sums: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(per-token advantages, per-token value loss, metrics) for one minibatch.
        ``global_sums(count, sum, sumsq) -> same, summed over ranks`` for the whitening."""
        assert self.model is not None, "critic not built"
        mask = batch["loss_mask"]
        values = self.model(batch["input_ids"], batch["attention_mask"])
        with torch.no_grad():
            v = values.detach()
            old = self._old_values(batch, v)
            rewards = terminal_rewards(batch["rewards"], mask)
            log_ratio = (logp.detach() - batch["behavior_logprobs"]) * mask
            # rho stays out of the policy advantage: the objective's ratio weights it already
            adv, targets = vtrace(
                rewards, v, log_ratio, mask, self.gamma, self.lam, self.rho_bar, self.c_bar, False
            )
            if self.whiten_advantages:
                m = mask.to(adv.dtype)
                sums = torch.stack([m.sum(), (adv * m).sum(), (adv * adv * m).sum()]).double()
                if global_sums is not None:
                    sums = global_sums(sums)
                adv = whiten(adv, mask, tuple(float(x) for x in sums))
        per_token = self.coef * value_loss(values, old, targets, mask, self.clip)
        denom = mask.sum().clamp_min(1)
        metrics = {
            "critic/value_mean": (v * mask).sum() / denom,
            "critic/target_mean": (targets * mask).sum() / denom,
            "critic/explained_var": explained_variance(v, targets, mask),
        }
        return adv, per_token, metrics


def explained_variance(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[target - pred] / Var[target] over real tokens (1: perfect, 0: no better than a constant)."""
    m = mask > 0
    t, p = target[m], pred[m]
    var = t.var(unbiased=False) if t.numel() > 1 else torch.tensor(0.0)
    return 1 - (t - p).var(unbiased=False) / var if var > 0 else torch.tensor(0.0)
