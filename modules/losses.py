"""Policy losses: pure functions of tensors (no module state), selected by ``_target_``.

All per-token tensors are ``[B, T]`` and aligned to targets; ``mask`` is 1 on trained
response tokens. ``advantages`` and ``weights`` are per sequence, ``[B]``.

Aggregation is token-mean over the minibatch: ``sum(mask * l) / sum(mask)``. Masked tokens
leave both numerator and denominator.

PPO-clip here anchors the ratio on the behaviour logprobs mu from the engine
(``r = pi_theta / mu``, "bypass" mode): in sync mode mu equals the trainer's pre-update
policy up to ~1e-6, and after the first minibatch the clip keeps later minibatches close to
the policy that generated the data, as in the textbook.
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def ppo_clip_loss(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, token-mean.

    ``loss = -mean_t w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)`` with
    ``r = exp(logp - behavior_logp)``. Returns ``(loss, metrics)``; metrics carry no grad.
    """
    log_ratio = (logp - behavior_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    adv = advantages.detach()[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights.detach()[:, None]
    loss = masked_mean(per_token, mask)
    with torch.no_grad():
        is_clipped = ((ratio < 1.0 - eps_low) & (adv < 0)) | ((ratio > 1.0 + eps_high) & (adv > 0))
        # k3 estimate of KL(mu || pi_theta) from tokens sampled by mu: r - 1 - log r.
        k3 = ratio - 1.0 - log_ratio
        metrics = {
            "clip_frac": masked_mean(is_clipped.float(), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "kl_behavior": masked_mean(k3, mask),
        }
    return loss, metrics
