"""Per-token advantages from a critic: GAE, and V-trace for samples from an older policy.

Pure functions of tensors, ``[B, T]`` over response tokens (``mask`` 1 on the tokens the model
sampled). ``values[b, t]`` is the critic's estimate of the return from token t on (the state
before token t is sampled); a response ends after its last real token, where the value is 0
(terminal). ``rewards[b, t]`` is the reward on token t: the outcome reward on the last token,
plus any per-token shaping. The recursions run over the masked-in tokens only, in order: a
multi-turn episode's observation tokens (mask 0 between two model turns) are part of the
environment's transition, so the next state after a turn's last token is the next turn's first
token, whose value already reads the observation (``_over_model_tokens``). For a right-padded
response (mask a prefix of the row) that is the plain recursion.

* ``gae``: Schulman et al.'s generalised advantage estimation,
  ``A_t = sum_k (gamma lam)^k delta_{t+k}``, ``delta_t = r_t + gamma V_{t+1} - V_t``; the value
  target is ``A_t + V_t`` (the lambda-return). With gamma = lam = 1 it is ``R - V_t``.
* ``vtrace``: Espeholt et al.'s off-policy targets (IMPALA) for tokens sampled by a behaviour
  policy mu while the critic and the trained policy are pi:
  ``v_s = V_s + sum_{t>=s} gamma^{t-s} (prod_{i=s}^{t-1} c_i) rho_t delta_t`` with truncated
  ratios ``rho_t = min(rho_bar, pi/mu)`` and ``c_i = lam min(c_bar, pi/mu)``; the policy
  advantage is ``rho_s (r_s + gamma v_{s+1} - V_s)``. On-policy (pi = mu) with
  rho_bar, c_bar >= 1 the targets are GAE's lambda-returns (tested), so one code path serves
  fresh and stale samples; the seeds name V-trace as the way to value stale samples.
* ``whiten``: advantages to zero mean and unit variance over real tokens (the sums can be
  given from an all-reduce, so DDP ranks whiten with the global batch's statistics).
"""

from __future__ import annotations

import torch


def _check(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"rewards, values and mask must share one [B, T] shape, got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    return mask.to(values.dtype)


def _over_model_tokens(fn, tensors: tuple[torch.Tensor, ...], mask: torch.Tensor) -> tuple:
    """``fn(*tensors, mask)`` run over each row's masked-in tokens, compacted to a right-padded
    prefix, its outputs put back in place (0 elsewhere): observation tokens between two model
    turns are skipped, not read as the episode's end. A mask that is already a prefix of each
    row (one-turn responses) goes straight through."""
    m = mask > 0
    counts = m.sum(dim=1)
    if bool((m == (torch.arange(m.shape[1], device=m.device)[None, :] < counts[:, None])).all()):
        return fn(*tensors, mask)
    width = int(counts.max())
    # a stable sort puts each row's masked-in positions first, in their order
    order = torch.sort((~m).to(torch.int8), dim=1, stable=True).indices[:, :width]
    keep = (torch.arange(width, device=m.device)[None, :] < counts[:, None]).to(mask.dtype)
    outs = fn(*(t.gather(1, order) * keep.to(t.dtype) for t in tensors), keep)
    return tuple(
        torch.zeros(mask.shape, dtype=o.dtype, device=o.device).scatter(1, order, o * keep.to(o.dtype))
        for o in outs
    )


def _next_values(values: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """V_{t+1}, 0 after a response's last real token (terminal) and on padding."""
    nxt = torch.zeros_like(values)
    nxt[:, :-1] = values[:, 1:] * m[:, 1:]
    return nxt


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, value targets), both ``[B, T]`` and 0 off the mask."""
    _check(rewards, values, mask)
    return _over_model_tokens(lambda r, v, m: _gae(r, v, m, gamma, lam), (rewards, values), mask)


def _gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    m = mask.to(values.dtype)
    delta = (rewards + gamma * _next_values(values, m) - values) * m
    adv = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):
        running = delta[:, t] + gamma * lam * running * m[:, t]
        adv[:, t] = running * m[:, t]
    return adv, (adv + values) * m


def vtrace(
    rewards: torch.Tensor,
    values: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    rho_in_advantage: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(policy advantages, value targets v_s) for tokens sampled by mu; ``log_ratio`` is
    log pi - log mu per token (detached: targets carry no gradient). ``rho_in_advantage=False``
    leaves rho_s out of the policy advantage, for objectives whose ratio already weights it
    (PPO-clip's pi / pi_old is pi / mu in the bypass anchor)."""
    _check(rewards, values, mask)
    return _over_model_tokens(
        lambda r, v, lr, m: _vtrace(r, v, lr, m, gamma, lam, rho_bar, c_bar, rho_in_advantage),
        (rewards, values, log_ratio),
        mask,
    )


def _vtrace(
    rewards: torch.Tensor,
    values: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    rho_bar: float,
    c_bar: float,
    rho_in_advantage: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    m = mask.to(values.dtype)
    ratio = torch.exp(log_ratio.detach()) * m
    rho = torch.clamp(ratio, max=rho_bar)
    c = lam * torch.clamp(ratio, max=c_bar)
    v_next = _next_values(values, m)
    delta = rho * (rewards + gamma * v_next - values) * m
    corr = torch.zeros_like(values)  # v_s - V_s
    running = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):
        running = delta[:, t] + gamma * c[:, t] * running * m[:, t]
        corr[:, t] = running * m[:, t]
    targets = (values + corr) * m
    next_targets = torch.zeros_like(values)
    next_targets[:, :-1] = targets[:, 1:] * m[:, 1:]
    adv = (rewards + gamma * next_targets - values) * m
    return (rho * adv if rho_in_advantage else adv), targets


def whiten(
    adv: torch.Tensor, mask: torch.Tensor, sums: tuple[float, float, float] | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """(adv - mean) / std over real tokens; ``sums`` = (count, sum, sum of squares) of the
    global batch when ranks hold shards (else this tensor's)."""
    m = mask.to(adv.dtype)
    if sums is None:
        sums = (float(m.sum()), float((adv * m).sum()), float((adv * adv * m).sum()))
    n, s, s2 = sums
    if n <= 0:
        return adv * m
    mean = s / n
    var = max(s2 / n - mean * mean, 0.0) * n / max(n - 1, 1)  # unbiased, as torch.std
    return (adv - mean) / (var**0.5 + eps) * m
