"""KL to the reference policy as a reward penalty (the PPO-RLHF form), instead of a loss term.

    python train.py algo.kl_reward.coef=0.05 module.ref_model_path=${model.path}   # e.g.

Each response's reward becomes ``r - coef * sum_t (log mu_t - log pi_ref_t)`` over its tokens
(k1 of the sampled tokens, mu the behaviour logprobs: the policy that generated them), and the
group advantages are recomputed from the shaped rewards, before the rollout batch's first
update. With an on-policy batch this optimises E[r] - coef * KL(pi || pi_ref) at the sequence
level: the penalty enters the return, so its gradient flows through the policy-gradient term
(log pi times the advantage), not through a loss term. The in-loss alternative
(``algo.loss.kl_coef``, ``losses.kl_penalty``) adds the per-token gradient of KL(pi || pi_ref)
directly and leaves rewards untouched; docs/estimators.md compares them.

Needs every response of a group on the same rank (checked at start-up under DDP) and a
group-wise advantage estimator (``algo/advantage=group``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from modules.config.errors import check


class KLRewardPenalty:
    def __init__(self, coef: float = 0.0, advantage: Any = None) -> None:
        check("algo.kl_reward.coef", coef, isinstance(coef, int | float) and coef >= 0, "a float >= 0")
        check(
            "algo.advantage",
            type(advantage).__name__,
            not coef or (advantage is not None and not advantage.per_response),
            "a group-wise estimator (algo/advantage=group) with algo.kl_reward.coef > 0",
        )
        self.coef = float(coef)
        self.advantage = advantage

    @property
    def enabled(self) -> bool:
        return self.coef > 0

    def apply(self, steps: list[dict[str, Any]], ref_logprobs: Callable[[dict], torch.Tensor]) -> float:
        """Shape the rewards of one rollout batch's minibatches in place and recompute their
        advantages; returns the mean penalty. Samples are keyed by (group id, index): the
        minibatches of later epochs hold the same samples again."""
        shaped: dict[tuple[int, int], float] = {}
        penalties = []
        for batch in steps:
            k1 = ((batch["behavior_logprobs"] - ref_logprobs(batch)) * batch["loss_mask"]).sum(dim=1)
            for i, key in enumerate(zip(batch["group_ids"].tolist(), batch["sample_indexes"].tolist())):
                if key not in shaped:
                    penalty = self.coef * float(k1[i])
                    shaped[key] = float(batch["rewards"][i]) - penalty
                    penalties.append(penalty)
        groups: dict[int, list[tuple[int, float]]] = {}
        for (gid, idx), r in shaped.items():
            groups.setdefault(gid, []).append((idx, r))
        advantages = {}
        for gid, members in groups.items():
            members.sort()
            for (idx, _), a in zip(members, self.advantage([r for _, r in members])):
                advantages[(gid, idx)] = float(a)
        for batch in steps:
            keys = zip(batch["group_ids"].tolist(), batch["sample_indexes"].tolist())
            batch["advantages"] = torch.tensor(
                [advantages[k] for k in keys],
                dtype=batch["advantages"].dtype,
                device=batch["advantages"].device,
            )
        return sum(penalties) / max(len(penalties), 1)


def kl_reward_needs_whole_groups(cfg: Any) -> None:
    """Cross-field rule: each DDP rank recomputes its groups' advantages from the KL-shaped
    rewards, so it must hold whole groups."""
    from modules.config.errors import batch_shape, world_size

    shape = batch_shape(cfg)
    if shape is None:
        return
    prompts, world = shape[0], world_size(cfg)
    coef = (cfg.algo.get("kl_reward") or {}).get("coef") or 0
    check(
        "algo.kl_reward.coef",
        coef,
        not coef or world == 1 or prompts % world == 0,
        f"0 unless rollout.prompts_per_step={prompts} is a multiple of the {world} ranks (each rank "
        "must hold whole groups to recompute their advantages from the shaped rewards)",
    )
