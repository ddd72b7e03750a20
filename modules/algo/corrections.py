"""Behaviour weights for off-policy tokens: pure, detached functions of log-probabilities.

Notation: mu = behaviour logprobs from the engine, pi_old = the trainer's logprobs at the start
of the update (no grad), pi = current policy. Every correction sees ``log_w = log pi_old -
log mu`` per token (0 everywhere in ``bypass`` mode, where pi_old := mu) and returns a weight
per token ``[B, T]`` that multiplies the per-token objective, plus diagnostics. Log-ratios are
clamped to +-20 before ``exp``. Weights never carry gradient.

Selected with ``algo/correction=<name>`` (``conf/algo/correction/``). What each corrects:

* ``none``: nothing. With staleness the estimator is biased.
* ``token_is``: per-token ratio. Low variance; ignores the shift in the distribution of
  prefixes (states), so it is biased once the lag K > 0, more so for long horizons.
* ``tis`` (cap C, default 2): token IS truncated at C. Lower variance, extra bias.
* ``seq_is`` / ``tseq_is``: product of token ratios over the response (truncated at C).
  Unbiased (untruncated) for the sequence-level objective; variance grows fast with length.
* ``geo_seq_is``: exp(mean_t log w): a per-sequence weight; no middle ground between token and
  sequence IS (on the exact-gradient harness it behaves like no correction).
* ``mis`` (lower, upper, level token|sequence|geometric): masked IS: the weight where the
  ratio is inside [lower, upper], zero outside (rejection of extreme samples).
* ``icepop`` (alpha 0.5, beta 5): token ratio kept inside [alpha, beta], zero outside.
* ``ds_seq_mask`` (delta): DeepSeek-V3.2 off-policy sequence masking: drop a sequence when its
  advantage is negative and mean_t log(mu / pi) > delta. A gate: kept tokens carry the token
  behaviour weight pi_old / mu (1 in bypass mode), dropped ones 0.
* ``m2po`` (tau 0.04): mask the tokens with the largest (log mu - log pi_old)^2 until the mean
  of the rest is below tau.
* ``vtrace`` (rho_bar, c_bar): min(rho_bar, w_t) * prod_{s<t} min(c_bar, w_s), the V-trace
  truncation applied along the response (no value function: traces only re-weight).
* ``lag`` (gamma): gamma ** staleness per sample (from the experience record), a gate like
  ``ds_seq_mask``: it multiplies the token behaviour weight pi_old / mu.

Any of them can be self-normalised (``self_normalize: true``): divided by the mean weight of
the samples it keeps (tokens for token-level weights, sequences for per-sequence ones);
rejected samples keep weight 0 and their place in the loss's denominator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from modules.config.errors import check, check_choice


def _positive(name: str, value: float | None, nullable: bool = True) -> None:
    ok = (nullable and value is None) or (value is not None and value > 0)
    check(f"algo.correction.{name}", value, ok, ("null or " if nullable else "") + "a float > 0")


def per_token_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """``[B]`` sequence advantages broadcast over tokens, or ``[B, T]`` per-token ones (a critic's)
    as they are; detached either way."""
    a = advantages.detach()
    return a[:, None] if a.dim() == 1 else a


LOG_CLAMP = 20.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def _seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(dim=1, keepdim=True)


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _seq_sum(x, mask) / mask.sum(dim=1, keepdim=True).clamp_min(1.0)


def _exp(log_w: torch.Tensor) -> torch.Tensor:
    return log_w.clamp(-LOG_CLAMP, LOG_CLAMP).exp()


def diagnostics(w: torch.Tensor, mask: torch.Tensor, log_w: torch.Tensor) -> dict[str, torch.Tensor]:
    """ESS fraction, weight quantiles, share zeroed, and mu vs pi_old mismatch (k1, k3, max)."""
    m = mask > 0
    vals = w[m]
    if vals.numel() == 0:
        vals = torch.ones(1)
    ess = vals.sum() ** 2 / (vals.numel() * (vals**2).sum()).clamp_min(1e-12)
    rho = _exp(log_w)
    return {
        "is/ess_frac": ess,
        "is/weight_min": vals.min(),
        "is/weight_mean": vals.mean(),
        "is/weight_max": vals.max(),
        "is/weight_p99": torch.quantile(vals.float(), 0.99),
        "is/zeroed_frac": (vals == 0).float().mean(),
        "mismatch/k1": masked_mean(-log_w, mask),  # KL(mu || pi_old), samples from mu
        "mismatch/k3": masked_mean(rho - 1 - log_w.clamp(-LOG_CLAMP, LOG_CLAMP), mask),
        "mismatch/max_abs_logp_diff": (log_w.abs() * mask).max() if m.any() else torch.zeros(()),
    }


RATIO_BAND = 0.2  # the shipped PPO clip: ratio/*_out_frac is the share of tokens outside 1 -+ it


def ratio_stats(log_ratio: torch.Tensor, mask: torch.Tensor, anchor: str) -> dict[str, torch.Tensor]:
    """``ratio/{anchor}_mean``, ``_max``, ``_min`` and ``_out_frac`` (outside [0.8, 1.2],
    either side, whatever the advantage's sign) of pi / anchor over the masked tokens. Logged
    for both anchors, mu and pi_old, so that a run whose objective clips against one still
    shows how far it moved from the other."""
    m = mask > 0
    r = log_ratio.detach()[m].exp() if m.any() else log_ratio.new_ones(1)
    return {
        f"ratio/{anchor}_mean": r.mean(),
        f"ratio/{anchor}_max": r.max(),
        f"ratio/{anchor}_min": r.min(),
        f"ratio/{anchor}_out_frac": ((r < 1 - RATIO_BAND) | (r > 1 + RATIO_BAND)).float().mean(),
    }


class Correction(ABC):
    """Base: ``__call__`` returns (weights [B, T] detached, metrics).

    ``uses_pi_old_over_mu``: the weight is a function of ``pi_old / mu``, which is 1 in
    ``bypass`` mode (pi_old := mu), so the correction needs ``algo.loss.anchor=decoupled``.
    ``gate``: the correction is a mask or a per-sample factor (``ds_seq_mask``, ``lag``) that
    multiplies the token behaviour weight ``pi_old / mu`` instead of replacing it (that weight
    is 1 in bypass mode, so there the gate acts alone).
    ``per_sequence``: one weight per sequence; self-normalisation then averages over
    sequences, not tokens.
    """

    uses_pi_old_over_mu = True
    gate = False
    per_sequence = False
    cap: float | None = None  # truncation C of the weight (gates: of the pi_old / mu they multiply)
    # an outer truncation of the final weight, None when off; set at run time by the drift
    # controller's ``truncate`` action (modules/callbacks/drift_controller.py). Like ``cap`` it applies before
    # self-normalisation, and the ``is/*`` diagnostics describe the weights after it.
    limit: float | None = None

    def __init__(self, self_normalize: bool = False) -> None:
        self.self_normalize = self_normalize

    @property
    def max_weight(self) -> float | None:
        """The largest weight it can give under the decoupled anchor, before ``limit`` and
        self-normalisation (None: unbounded). A gate's factor is <= 1, so its bound is the
        cap of the behaviour weight it multiplies."""
        return self.cap

    @abstractmethod
    def weights(self, log_w: torch.Tensor, mask: torch.Tensor, ctx: dict) -> torch.Tensor:
        """Per-token weights [B, T] from log_w = log pi_old - log mu (and ctx); a gate's factor."""

    def __call__(self, log_w: torch.Tensor, mask: torch.Tensor, **ctx: torch.Tensor) -> tuple:
        log_w = log_w.detach()
        w = self.weights(log_w, mask, ctx).detach() * mask
        per_sequence = self.per_sequence
        if self.gate and bool(((log_w * mask) != 0).any()):  # decoupled: pi_old / mu != 1
            w = w * self.behaviour_weight(log_w)  # now a token-level weight
            per_sequence = False
        if self.limit is not None:
            w = w.clamp(max=self.limit)
        if self.self_normalize:
            w = self_normalized(w, mask, per_sequence)
        return w, diagnostics(w, mask, log_w)

    def behaviour_weight(self, log_w: torch.Tensor) -> torch.Tensor:
        """The token weight pi_old / mu a gate multiplies (capped at ``cap`` when set)."""
        w = _exp(log_w)
        return w if self.cap is None else w.clamp(max=self.cap)


def self_normalized(w: torch.Tensor, mask: torch.Tensor, per_sequence: bool) -> torch.Tensor:
    """Weights divided by their mean over the samples they keep (weight > 0): a rejected
    token or sequence keeps its zero and its place in the loss's denominator, and the
    survivors' scale is not inflated by it. Token-level weights average over kept tokens,
    per-sequence weights over kept sequences (each sequence counts once, whatever its length)."""
    if per_sequence:
        n = mask.sum(dim=1)
        seq_w = (w * mask).sum(dim=1) / n.clamp_min(1.0)  # the sequence's (constant) weight
        kept = (n > 0) & (seq_w > 0)
        mean = seq_w[kept].mean() if kept.any() else seq_w.new_ones(())
    else:
        kept = (mask > 0) & (w > 0)
        mean = w[kept].mean() if kept.any() else w.new_ones(())
    return w / mean.clamp_min(1e-12)


class NoCorrection(Correction):
    uses_pi_old_over_mu = False
    max_weight = 1.0

    def weights(self, log_w, mask, ctx):
        return torch.ones_like(log_w)


class TokenIS(Correction):
    def weights(self, log_w, mask, ctx):
        return _exp(log_w)


class TruncatedTokenIS(Correction):
    def __init__(self, cap: float = 2.0, self_normalize: bool = False) -> None:
        super().__init__(self_normalize)
        _positive("cap", cap, nullable=False)
        self.cap = cap

    def weights(self, log_w, mask, ctx):
        return _exp(log_w).clamp(max=self.cap)


class SequenceIS(Correction):
    per_sequence = True

    def __init__(self, cap: float | None = None, self_normalize: bool = False) -> None:
        super().__init__(self_normalize)
        _positive("cap", cap)
        self.cap = cap

    def weights(self, log_w, mask, ctx):
        w = _exp(_seq_sum(log_w, mask)).expand_as(log_w)
        return w if self.cap is None else w.clamp(max=self.cap)


class GeometricSequenceIS(Correction):
    per_sequence = True

    def weights(self, log_w, mask, ctx):
        return _exp(_seq_mean(log_w, mask)).expand_as(log_w)


class MaskedIS(Correction):
    def __init__(
        self, lower: float = 0.5, upper: float = 2.0, level: str = "token", self_normalize: bool = False
    ) -> None:
        super().__init__(self_normalize)
        check_choice("algo.correction.level", level, ("token", "sequence", "geometric"))
        _positive("upper", upper, nullable=False)
        check(
            "algo.correction.lower",
            lower,
            0 <= lower < upper,
            f"a float in [0, algo.correction.upper={upper})",
        )
        self.lower, self.upper, self.level = lower, upper, level
        self.per_sequence = level != "token"

    def weights(self, log_w, mask, ctx):
        if self.level == "token":
            rho = _exp(log_w)
        elif self.level == "sequence":
            rho = _exp(_seq_sum(log_w, mask)).expand_as(log_w)
        else:
            rho = _exp(_seq_mean(log_w, mask)).expand_as(log_w)
        keep = (rho >= self.lower) & (rho <= self.upper)
        return torch.where(keep, rho, torch.zeros_like(rho))

    @property
    def max_weight(self) -> float | None:
        return self.upper


class IcePop(MaskedIS):
    def __init__(self, alpha: float = 0.5, beta: float = 5.0, self_normalize: bool = False) -> None:
        _positive("alpha", alpha, nullable=False)
        _positive("beta", beta, nullable=False)
        check("algo.correction.alpha", alpha, alpha < beta, f"a float below algo.correction.beta={beta}")
        super().__init__(alpha, beta, "token", self_normalize)


class DeepSeekSequenceMask(Correction):
    """Needs ``logp`` (current pi, detached) and ``advantages`` in ctx."""

    uses_pi_old_over_mu = False
    gate = True
    per_sequence = True

    def __init__(self, delta: float = 0.1, cap: float | None = None, self_normalize: bool = False) -> None:
        super().__init__(self_normalize)
        _positive("delta", delta, nullable=False)
        _positive("cap", cap)
        self.delta = delta
        self.cap = cap  # truncation of the behaviour weight pi_old / mu it multiplies

    def weights(self, log_w, mask, ctx):
        log_mu_over_pi = ctx["behavior_logp"] - ctx["logp"].detach()
        drop = (per_token_advantages(ctx["advantages"]) < 0) & (_seq_mean(log_mu_over_pi, mask) > self.delta)
        return (~drop).float().expand_as(log_w)


class M2PO(Correction):
    max_weight = 1.0  # a 0 / 1 mask

    def __init__(self, tau: float = 0.04, self_normalize: bool = False) -> None:
        super().__init__(self_normalize)
        _positive("tau", tau, nullable=False)
        self.tau = tau

    def weights(self, log_w, mask, ctx):
        sq = (log_w**2) * mask
        flat = sq[mask > 0]
        keep = torch.ones_like(log_w)
        if flat.numel() == 0 or flat.mean() <= self.tau:
            return keep
        order = torch.sort(flat, descending=True).values
        n = order.numel()
        rest_sum = order.sum() - torch.cumsum(order, 0)  # sum after removing the top k+1
        rest_n = torch.arange(n - 1, -1, -1, dtype=order.dtype)
        ok = (rest_sum / rest_n.clamp_min(1)) <= self.tau
        k = int(torch.nonzero(ok)[0]) + 1 if ok.any() else n  # tokens to mask
        threshold = order[k - 1]
        return torch.where(sq >= threshold, torch.zeros_like(log_w), keep) if k > 0 else keep


class VTrace(Correction):
    def __init__(self, rho_bar: float = 1.0, c_bar: float = 1.0, self_normalize: bool = False) -> None:
        super().__init__(self_normalize)
        _positive("rho_bar", rho_bar, nullable=False)
        _positive("c_bar", c_bar, nullable=False)
        self.rho_bar, self.c_bar = rho_bar, c_bar

    def weights(self, log_w, mask, ctx):
        w = _exp(log_w)
        log_c = torch.log(w.clamp(max=self.c_bar).clamp_min(1e-12)) * mask
        prefix = torch.cumsum(log_c, dim=1) - log_c  # sum over s < t
        return w.clamp(max=self.rho_bar) * prefix.exp()

    @property
    def max_weight(self) -> float | None:
        return self.rho_bar if self.c_bar <= 1 else None  # traces > 1 compound along the response


class LagWeight(Correction):
    """gamma ** staleness per sample; needs ``staleness`` [B] in ctx."""

    uses_pi_old_over_mu = False
    gate = True
    per_sequence = True

    def __init__(self, gamma: float = 0.9, cap: float | None = None, self_normalize: bool = False) -> None:
        super().__init__(self_normalize)
        check("algo.correction.gamma", gamma, 0 < gamma <= 1, "a float in (0, 1]")
        _positive("cap", cap)
        self.gamma = gamma
        self.cap = cap  # truncation of the behaviour weight pi_old / mu it multiplies

    def weights(self, log_w, mask, ctx):
        return (self.gamma ** ctx["staleness"].float())[:, None].expand_as(log_w)
