"""Policy losses: pure functions of tensors (no module state), selected by ``_target_``.

A loss is assembled from independent parts, each chosen in ``conf/algo``:

    policy_loss = aggregate( objective(logp, anchor, A) * behaviour_weight * sample_weight )
                  + kl_coef * aggregate( kl(logp, ref_logp) )

* **objective** (per token, ``[B, T]``): ``ppo_clip`` (eps_low / eps_high, optional dual clip
  c for A < 0), ``cispo``, ``gspo``, ``gmpo``, ``reinforce``.
* **anchor**: ``bypass`` uses the behaviour logprobs mu as pi_old (``r = pi / mu``);
  ``decoupled`` (AReaL) uses the trainer's pi_old (``r = pi / pi_old``) and a detached
  behaviour weight ``w = pi_old / mu`` from ``modules/algo/corrections.py``. In bypass mode
  ``w = 1``: only ``ds_seq_mask`` (looks at pi) and ``lag`` (looks at staleness) act there,
  and the config validator rejects the weight-based corrections with ``bypass``.
* **aggregation**: ``token_mean`` = sum(mask * l) / sum(mask) over the batch;
  ``seq_mean_token_mean`` (original GRPO) = mean over sequences of each sequence's token mean;
  ``seq_mean_token_sum`` = mean over sequences of token sums; ``seq_mean_token_sum_norm``
  (Dr.GRPO) = sum(mask * l) / (B * norm_const). Masked tokens (mask 0, including tokens a
  correction zeroes *through the weight*) keep their place in the denominator: a correction
  that rejects a token removes its gradient, not its share of the normaliser.
* **kl** to a reference policy in the loss: the value is a k1 / k2 / k3 estimate of
  KL(pi || pi_ref) (rho = pi_ref / pi), the gradient that of KL(pi || pi_ref) (``kl_penalty``).
* **DDP**: with ``totals`` (the normalisers summed over ranks) every aggregation gives, after
  DDP's gradient average, the gradient of one process on the whole batch.

``PolicyLoss`` (``algo.loss`` in the config) holds one such choice, validates it at start-up
and says which extra inputs the module must compute: ``needs_old_logprobs`` (decoupled anchor:
the trainer's pi_old) and ``needs_reference`` (a KL term: the reference policy's logprobs).

All tensors per token are aligned to targets; ``weights`` are ``[B]``, ``advantages`` ``[B]`` (group
advantages) or ``[B, T]`` (per token, from a critic: ``modules/policy/critic.py``).
Log-ratios are clamped to +-20 before ``exp``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from modules.algo.corrections import (
    LOG_CLAMP,
    Correction,
    NoCorrection,
    diagnostics,
    masked_mean,
    per_token_advantages,
    ratio_stats,
)
from modules.config.errors import check, check_choice

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
ANCHORS = ("bypass", "decoupled")
KL_KINDS = ("k1", "k2", "k3")


def batch_counts(mask: torch.Tensor) -> torch.Tensor:
    """What the aggregations divide by, for one (local) batch: [tokens, sequences with at least
    one token, sequences]. Under DDP the module sums these over ranks (``totals``)."""
    return torch.stack(
        [mask.sum(), (mask.sum(dim=1) > 0).sum().to(mask.dtype), mask.new_tensor(float(mask.shape[0]))]
    )


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    norm_const: float | None = None,
    totals: torch.Tensor | None = None,
    world_size: int = 1,
) -> torch.Tensor:
    """Reduce ``[B, T]`` per-token losses to the scalar the optimizer follows.

    ``totals`` (``batch_counts`` summed over ``world_size`` data-parallel ranks) makes each
    rank's loss its share of the *global* aggregate, scaled by ``world_size`` so that DDP's
    gradient average gives the gradient of one process on the whole batch. Without it the
    batch is the whole batch.
    """
    if totals is None:
        totals, world_size = batch_counts(mask), 1
    tokens, seqs_with_tokens, seqs = (t.to(per_token.dtype) for t in totals)
    seq_tokens = mask.sum(dim=1)
    seq_sum = (per_token * mask).sum(dim=1)
    if mode == "token_mean":
        return seq_sum.sum() * world_size / tokens.clamp_min(1.0)
    if mode == "seq_mean_token_mean":
        has = seq_tokens > 0
        return (seq_sum[has] / seq_tokens[has]).sum() * world_size / seqs_with_tokens.clamp_min(1.0)
    if mode == "seq_mean_token_sum":
        return seq_sum.sum() * world_size / seqs
    if mode == "seq_mean_token_sum_norm":
        if not norm_const:
            raise ValueError(
                "algo.loss.aggregation=seq_mean_token_sum_norm needs algo.loss.norm_const (e.g. max_tokens)"
            )
        return seq_sum.sum() * world_size / (seqs * norm_const)
    raise ValueError(f"algo.loss.aggregation={mode!r}: must be one of {', '.join(AGGREGATIONS)}")


def _log_ratio(logp: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    return (logp - anchor.detach()).clamp(-LOG_CLAMP, LOG_CLAMP)


# ---------------------------------------------------------------------------- objectives
# Each returns (per-token loss [B, T], metrics). ``anchor`` is pi_old (or mu in bypass mode).


def check_objective(objective: Callable) -> None:
    """The clip arguments an objective (a ``functools.partial`` from ``conf/algo/objective``)
    was configured with, checked at start-up: the objectives themselves only run in a step."""
    kw = getattr(objective, "keywords", None) or {}
    for side in ("eps_low", "eps_high"):
        if side in kw:
            check(f"algo.objective.{side}", kw[side], kw[side] is not None and kw[side] >= 0, "a float >= 0")
    if kw.get("eps_low") is not None:
        check(
            "algo.objective.eps_low",
            kw["eps_low"],
            kw["eps_low"] < 1,
            "a float in [0, 1) (1 - eps_low is the lower clip bound of a probability ratio)",
        )
    if kw.get("dual_clip") is not None:
        check("algo.objective.dual_clip", kw["dual_clip"], kw["dual_clip"] > 1, "null or a float > 1")
    if "eps" in kw:
        check("algo.objective.eps", kw["eps"], kw["eps"] is not None and kw["eps"] > 0, "a float > 0")


def ppo_clip(
    logp,
    anchor,
    advantages,
    mask,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
):
    """-min(r A, clip(r, 1-eps_low, 1+eps_high) A); with dual_clip c, A<0 tokens are also
    bounded by -c A (their loss cannot exceed c |A|)."""
    log_ratio = _log_ratio(logp, anchor)
    ratio = log_ratio.exp()
    adv = per_token_advantages(advantages)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -dual_clip * adv), per_token)
    with torch.no_grad():
        clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
        metrics = {"clip_frac": masked_mean(clipped.float(), mask), "ratio_mean": masked_mean(ratio, mask)}
    return per_token, metrics


def cispo(logp, anchor, advantages, mask, eps_low: float = 0.2, eps_high: float = 0.2):
    """-sg(clip(r)) A log pi: clipped tokens still pass gradient through log pi."""
    ratio = _log_ratio(logp, anchor).exp()
    w = ratio.clamp(1 - eps_low, 1 + eps_high).detach()
    per_token = -w * per_token_advantages(advantages) * logp
    with torch.no_grad():
        clipped = (ratio < 1 - eps_low) | (ratio > 1 + eps_high)
        metrics = {"clip_frac": masked_mean(clipped.float(), mask), "ratio_mean": masked_mean(ratio, mask)}
    return per_token, metrics


def gspo(logp, anchor, advantages, mask, eps_low: float = 3e-4, eps_high: float = 4e-4):
    """Sequence ratio s = exp(mean_t log r), clipped at sequence level; the per-token form
    s_t = sg(s) * pi / sg(pi) gives every token the sequence's (clipped) weight."""
    log_ratio = _log_ratio(logp, anchor)
    seq_log = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1)
    s_tok = seq_log.detach().exp() * (logp - logp.detach()).exp()
    adv = per_token_advantages(advantages)
    per_token = -torch.minimum(s_tok * adv, s_tok.clamp(1 - eps_low, 1 + eps_high) * adv)
    with torch.no_grad():
        s = seq_log.exp()
        clipped = ((s < 1 - eps_low) & (adv < 0)) | ((s > 1 + eps_high) & (adv > 0))
        metrics = {"clip_frac": clipped.float().mean(), "ratio_mean": s.mean()}
    return per_token, metrics


def gmpo(logp, anchor, advantages, mask, eps: float = 0.4):
    """Geometric mean of token ratios, each clipped in log space to [-eps, eps] on the side the
    advantage's sign makes pessimistic; one weight per sequence, spread over its tokens."""
    log_ratio = _log_ratio(logp, anchor)
    adv = per_token_advantages(advantages)
    sign = torch.sign(adv)
    clipped = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-eps, eps))
    n = mask.sum(1, keepdim=True).clamp_min(1)
    seq_ratio = ((clipped * mask).sum(1, keepdim=True) / n).exp()
    # one value per sequence on every token: aggregate with seq_mean_token_mean for the paper's form
    per_token = -(seq_ratio * adv).expand_as(logp)
    with torch.no_grad():
        metrics = {
            # A = 0 tokens are not clipped (their sign zeroes the log-ratio, and their gradient)
            "clip_frac": masked_mean(((clipped != log_ratio) & (adv != 0)).float(), mask),
            "ratio_mean": seq_ratio.mean(),
        }
    return per_token, metrics


def reinforce(logp, anchor, advantages, mask):
    """Plain REINFORCE with importance sampling: -sg(r) A log pi (no clipping)."""
    ratio = _log_ratio(logp, anchor).exp().detach()
    per_token = -ratio * per_token_advantages(advantages) * logp
    return per_token, {"clip_frac": torch.zeros(()), "ratio_mean": masked_mean(ratio, mask)}


# ---------------------------------------------------------------------------- KL to reference


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) term for the loss, on tokens sampled from pi.

    Its *value* is the chosen estimator of KL(pi || pi_ref) (rho = pi_ref / pi): ``k1`` = -log
    rho, ``k2`` = (log rho)^2 / 2, ``k3`` = rho - 1 - log rho (unbiased, low variance). Its
    *gradient* is (log pi - log pi_ref) * grad log pi for every kind, whose expectation under pi
    at a given prefix is exactly the gradient of that token's KL(pi(.|prefix) || pi_ref(.|prefix)).
    Differentiating the estimators themselves would not be: k1's gradient has expectation 0 and
    k3's is the gradient of KL(pi_ref || pi); only k2's matches, and that is the gradient used
    here. Summed over a response it is the per-token KL's gradient with the prefixes held fixed,
    not the sequence KL's (which also moves the prefixes: put the KL in the reward for that,
    ``modules/algo/kl_reward.py``); tokens sampled from a stale mu get no IS weight here.
    """
    log_rho = (ref_logp.detach() - logp).clamp(-LOG_CLAMP, LOG_CLAMP)
    if kind == "k1":
        value = -log_rho
    elif kind == "k2":
        value = 0.5 * log_rho**2
    elif kind == "k3":
        value = log_rho.exp() - 1 - log_rho
    else:
        raise ValueError(f"algo.loss.kl_kind={kind!r}: must be one of {', '.join(KL_KINDS)}")
    return value.detach() + (-log_rho).detach() * (logp - logp.detach())


# ---------------------------------------------------------------------------- assembled loss


def policy_loss(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    objective: Callable = ppo_clip,
    correction: Correction | None = None,
    anchor: str = "bypass",
    aggregation: str = "token_mean",
    norm_const: float | None = None,
    old_logp: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    staleness: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_kind: str = "k3",
    kl_coef: float = 0.0,
    totals: torch.Tensor | None = None,
    world_size: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training loss and its metrics (see module docstring).

    In ``bypass`` mode ``old_logp`` may still be given: rows whose pi_old was recomputed by the
    ``Recompute`` staleness policy (the module passes mu for the other rows), so their ratio
    restarts at the current policy. Bypass has no behaviour weight: the correction still sees
    pi_old / mu = 1 (a gate acts alone), and ``mismatch/*`` measures pi against mu.
    ``totals`` / ``world_size``: global normalisers under DDP (``aggregate``).
    """
    if anchor not in ANCHORS:
        raise ValueError(f"algo.loss.anchor={anchor!r}: must be one of {', '.join(ANCHORS)}")
    if anchor == "decoupled" and old_logp is None:
        raise ValueError("algo.loss.anchor=decoupled needs the trainer's pi_old logprobs (old_logp)")
    pi_old = behavior_logp if old_logp is None else old_logp
    correction = correction or NoCorrection()
    log_w = (pi_old - behavior_logp).detach() if anchor == "decoupled" else torch.zeros_like(logp)
    w, metrics = correction(
        log_w,
        mask,
        logp=logp.detach(),
        behavior_logp=behavior_logp,
        advantages=advantages,
        staleness=staleness if staleness is not None else torch.zeros(len(logp), device=logp.device),
    )
    if anchor == "bypass":  # w is 1 here; still report how far pi has moved from mu
        drift = diagnostics(w, mask, (logp.detach() - behavior_logp).clamp(-LOG_CLAMP, LOG_CLAMP))
        metrics.update({k: v for k, v in drift.items() if k.startswith("mismatch/")})
    per_token, obj_metrics = objective(logp, pi_old, advantages, mask)
    per_token = per_token * w
    if weights is not None:
        per_token = per_token * weights.detach()[:, None]
    loss = aggregate(per_token, mask, aggregation, norm_const, totals, world_size)
    with torch.no_grad():
        # k3 estimate of KL(mu || pi) on the sampled tokens: r - 1 - log r, r = pi / mu.
        lr = _log_ratio(logp, behavior_logp)
        metrics["kl_behavior"] = masked_mean(lr.exp() - 1 - lr, mask)
        # the ratio against each anchor, whichever one the objective clips (equal in bypass)
        metrics.update(ratio_stats(lr, mask, "mu"))
        metrics.update(ratio_stats(_log_ratio(logp, pi_old), mask, "pi_old"))
    metrics.update(obj_metrics)
    if kl_coef and ref_logp is not None:
        kl = aggregate(kl_penalty(logp, ref_logp, kl_kind), mask, aggregation, norm_const, totals, world_size)
        loss = loss + kl_coef * kl
        metrics["kl_ref"] = kl.detach()
    return loss, metrics


class PolicyLoss:
    """The configured loss (``algo.loss``): ``policy_loss`` with its parts fixed.

    Validates its fields at construction (before any model is built) and tells the module
    what to compute besides the current logprobs.
    """

    def __init__(
        self,
        objective: Callable = ppo_clip,
        correction: Correction | None = None,
        anchor: str = "bypass",
        aggregation: str = "token_mean",
        norm_const: float | None = None,
        kl_kind: str = "k3",
        kl_coef: float = 0.0,
    ) -> None:
        check_choice("algo.loss.anchor", anchor, ANCHORS)
        check_choice("algo.loss.aggregation", aggregation, AGGREGATIONS)
        if aggregation == "seq_mean_token_sum_norm":
            check(
                "algo.loss.norm_const",
                norm_const,
                (norm_const or 0) > 0,
                "a number > 0 for seq_mean_token_sum_norm (e.g. rollout.sampling.max_tokens)",
            )
        check_choice("algo.loss.kl_kind", kl_kind, KL_KINDS)
        check("algo.loss.kl_coef", kl_coef, (kl_coef or 0.0) >= 0, "a float >= 0")
        check_objective(objective)
        correction = correction or NoCorrection()
        check(
            "algo.loss.anchor",
            anchor,
            anchor == "decoupled" or not correction.uses_pi_old_over_mu,
            f"decoupled with algo/correction={type(correction).__name__} (in bypass mode pi_old := mu, "
            "so its weight pi_old/mu is 1 and the correction would do nothing)",
        )
        self.objective = objective
        self.correction = correction
        self.anchor = anchor
        self.aggregation = aggregation
        self.norm_const = norm_const
        self.kl_kind = kl_kind
        self.kl_coef = float(kl_coef or 0.0)

    @property
    def needs_old_logprobs(self) -> bool:
        """Decoupled PPO: the trainer's logprobs before the rollout batch's first update."""
        return self.anchor == "decoupled"

    @property
    def needs_reference(self) -> bool:
        """A KL term to a reference policy is part of the loss."""
        return self.kl_coef > 0

    def __call__(
        self,
        logp: torch.Tensor,
        behavior_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        old_logp: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        staleness: torch.Tensor | None = None,
        ref_logp: torch.Tensor | None = None,
        totals: torch.Tensor | None = None,
        world_size: int = 1,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return policy_loss(
            logp,
            behavior_logp,
            advantages,
            mask,
            objective=self.objective,
            correction=self.correction,
            anchor=self.anchor,
            aggregation=self.aggregation,
            norm_const=self.norm_const,
            old_logp=old_logp,
            weights=weights,
            staleness=staleness,
            ref_logp=ref_logp,
            kl_kind=self.kl_kind,
            kl_coef=self.kl_coef,
            totals=totals,
            world_size=world_size,
        )


def ppo_clip_loss(
    logp, behavior_logp, advantages, mask, eps_low: float = 0.2, eps_high: float = 0.2, weights=None, **kwargs
):
    """PPO-clip in bypass mode with token-mean aggregation (the default GRPO loss)."""

    def objective(lp, anc, adv, m):
        return ppo_clip(lp, anc, adv, m, eps_low, eps_high)

    return policy_loss(logp, behavior_logp, advantages, mask, objective=objective, weights=weights, **kwargs)
