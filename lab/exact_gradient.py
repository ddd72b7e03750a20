"""Exact-gradient harness: bias and variance of each off-policy correction, vs horizon and lag.

    python -m lab.exact_gradient                  # table as JSON (last line) + PNG
    python -m lab.exact_gradient --horizons 4 16 64 --lags 0 1 4

Problem: H binary tokens, each 1 with probability sigmoid(theta_t) (a per-position policy);
reward 1 when at least k tokens are 1, with k = ceil(E_pi[count]) so that J stays near 1/2 at
every H (no saturation). J(theta) = P(count >= k) is computed exactly by dynamic programming
over the count, and its gradient by autograd through that DP. The behaviour policy mu is a
controlled lag: theta_mu = theta - K * delta * sign(grad J(theta)), delta = 0.15 per token and
per version (successive RL updates keep moving the same way), so the per-token shift is
constant and the sequence-level KL(mu || pi) (reported, exact) grows like H K^2.

Each estimator is the trainer's own loss (``modules.algo.losses.policy_loss`` with the REINFORCE
objective, decoupled anchor, ``seq_mean_token_sum`` aggregation and the correction under test),
differentiated by autograd on samples drawn from mu, with advantage r - J(theta). For H <= 12
the expectation over mu is exact (all 2^H sequences weighted by mu); above, it is a Monte
Carlo mean over 20,000 samples with its standard error (``bias_se``). Bias =
|E[g] - grad J| / |grad J|; variance = E|g - E g|^2 / |grad J|^2 for one sample (divide by B
for a batch of B), from 400 single-sample estimates: a lower bound where the weights are
heavy-tailed (sequence IS at large H K).

    python -m lab.exact_gradient --scaling        # + the batch-size question (below)

``--scaling``: the seed's compute-scaling hypothesis. At a lag where token-level corrections are
biased, does a low-bias sequence-level estimator overtake the truncated / masked ones as the
batch grows? For each (H, K, estimator, batch B) the relative mean squared error of the batch
gradient, E|g_B - grad J|^2 / |grad J|^2, is measured directly from ``--reps`` independent
batches of B samples (not bias^2 + var / B: self-normalised estimators are not batch means, and
the 400-sample variance understates heavy tails). ``crossing`` reports, per (H, K) and
low-bias estimator, the smallest B at which its MSE is below every truncated / masked
estimator's, or null when it never is within the batches tried. Writes ``scaling.json`` and
``scaling.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch

from modules.algo import corrections as C
from modules.algo.losses import policy_loss, reinforce

ESTIMATORS = {
    "none": C.NoCorrection(),
    "ds_seq_mask": C.DeepSeekSequenceMask(0.1),
    "token_is": C.TokenIS(),
    "tis": C.TruncatedTokenIS(2.0),
    "seq_is": C.SequenceIS(),
    "tseq_is": C.SequenceIS(cap=2.0),
    "geo_seq_is": C.GeometricSequenceIS(),
    "mis_token": C.MaskedIS(0.5, 2.0, "token"),
    "mis_sequence": C.MaskedIS(0.5, 2.0, "sequence"),
    "mis_geometric": C.MaskedIS(0.5, 2.0, "geometric"),
    "icepop": C.IcePop(0.5, 5.0),
    "vtrace": C.VTrace(1.0, 1.0),
}


def objective(theta: torch.Tensor, k: int) -> torch.Tensor:
    """J = P(#ones >= k) by DP over the count (Poisson-binomial)."""
    h = theta.shape[0]
    p = torch.sigmoid(theta)
    dist = torch.zeros(h + 1, dtype=theta.dtype)
    dist = dist.index_put((torch.tensor([0]),), torch.ones(1, dtype=theta.dtype))
    for t in range(h):
        shifted = torch.cat([torch.zeros(1, dtype=theta.dtype), dist[:-1]])
        dist = dist * (1 - p[t]) + shifted * p[t]
    return dist[k:].sum()


def exact_grad(theta: torch.Tensor, k: int) -> tuple[float, torch.Tensor]:
    th = theta.detach().clone().requires_grad_(True)
    j = objective(th, k)
    (g,) = torch.autograd.grad(j, th)
    return j.item(), g


def make_problem(
    h: int, lag: int, step: float = 0.15, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(theta, theta_mu, k): theta_mu lags theta by `lag` versions of `step` per token."""
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(h, generator=gen, dtype=torch.float64) * 0.5
    k = math.ceil(torch.sigmoid(theta).sum().item())
    # RL updates keep moving the same way: mu sits behind theta along the ascent direction
    _, g = exact_grad(theta, k)
    theta_mu = theta - lag * step * torch.sign(g)
    return theta, theta_mu, k


def sequence_kl(theta_mu: torch.Tensor, theta: torch.Tensor) -> float:
    """KL(mu || pi) over whole sequences: a sum of per-position Bernoulli KLs."""
    pm, pp = torch.sigmoid(theta_mu), torch.sigmoid(theta)
    return (pm * (pm / pp).log() + (1 - pm) * ((1 - pm) / (1 - pp)).log()).sum().item()


def logprobs(theta: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return y * torch.nn.functional.logsigmoid(theta) + (1 - y) * torch.nn.functional.logsigmoid(-theta)


def estimate(theta, theta_mu, y, correction, k, sample_weights=None, j: float | None = None) -> torch.Tensor:
    """The trainer's surrogate gradient (ascent direction) on sequences y [N, H] drawn from mu."""
    th = theta.detach().clone().requires_grad_(True)
    logp = logprobs(th, y)
    mu = logprobs(theta_mu, y)
    if j is None:
        j, _ = exact_grad(theta, k)
    reward = (y.sum(1) >= k).to(y.dtype)
    loss, _ = policy_loss(
        logp,
        mu,
        reward - j,
        torch.ones_like(y),
        objective=reinforce,
        correction=correction,
        anchor="decoupled",
        old_logp=logp.detach(),
        aggregation="seq_mean_token_sum",
        weights=sample_weights,
    )
    (g,) = torch.autograd.grad(-loss, th)
    return g


def all_sequences(h: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product([0.0, 1.0], repeat=h)), dtype=torch.float64)


def measure(h: int, lag: int, name: str, samples: int = 20000, seed: int = 0, n_var: int = 400) -> dict:
    theta, theta_mu, k = make_problem(h, lag, seed=seed)
    j, true_g = exact_grad(theta, k)
    corr = ESTIMATORS[name]
    gen = torch.Generator().manual_seed(seed + 1)

    def draw(n: int) -> torch.Tensor:
        return (torch.rand(n, h, generator=gen, dtype=torch.float64) < torch.sigmoid(theta_mu)).double()

    # per-sample variance from independent single-sample estimates
    per = torch.stack([estimate(theta, theta_mu, y[None], corr, k, j=j) for y in draw(n_var)])
    var = ((per - per.mean(0)) ** 2).sum(1).mean()
    norm = true_g.norm()
    if h <= 12:  # exact expectation: every sequence, weighted by its probability under mu
        ys = all_sequences(h)
        mu_prob = logprobs(theta_mu, ys).sum(1).exp()
        mean_g = estimate(theta, theta_mu, ys, corr, k, sample_weights=mu_prob * len(ys), j=j)
        se = 0.0
    else:
        mean_g = estimate(theta, theta_mu, draw(samples), corr, k, j=j)
        se = math.sqrt(var.item() / samples) / norm.item()
    return {
        "H": h,
        "K": lag,
        "estimator": name,
        "bias": ((mean_g - true_g).norm() / norm).item(),
        "bias_se": se,
        "var_per_sample": (var / norm**2).item(),
        "exact_expectation": h <= 12,
        "J": j,
        "seq_kl_mu_pi": sequence_kl(theta_mu, theta),
    }


# Batch-level estimators: only meaningful in the batch study (a batch of one self-normalises to
# weight 1, and the exact expectation weights sequences by mu, not a batch mean).
SCALING_ONLY = {"seq_is_sn": C.SequenceIS(self_normalize=True)}  # weighted IS: O(1/B) bias
LOW_BIAS = ("seq_is", "tseq_is", "seq_is_sn")
TRUNCATED = ("token_is", "tis", "icepop", "mis_token", "mis_sequence", "vtrace", "ds_seq_mask")


def batch_mse(h: int, lag: int, name: str, batch: int, reps: int = 30, seed: int = 0) -> dict:
    """Relative MSE of the gradient from one batch of ``batch`` samples, over ``reps`` batches."""
    theta, theta_mu, k = make_problem(h, lag, seed=seed)
    j, true_g = exact_grad(theta, k)
    gen = torch.Generator().manual_seed(seed + 7)
    errs = []
    for _ in range(reps):
        y = (torch.rand(batch, h, generator=gen, dtype=torch.float64) < torch.sigmoid(theta_mu)).double()
        g = estimate(theta, theta_mu, y, {**ESTIMATORS, **SCALING_ONLY}[name], k, j=j)
        errs.append(((g - true_g).norm() / true_g.norm()).item() ** 2)
    mean = sum(errs) / reps
    se = math.sqrt(sum((e - mean) ** 2 for e in errs) / (reps - 1) / reps)
    return {"H": h, "K": lag, "estimator": name, "batch": batch, "rel_mse": mean, "rel_mse_se": se}


def crossings(rows: list[dict]) -> list[dict]:
    """Per (H, K) and low-bias estimator: the smallest batch where its MSE beats every
    truncated / masked estimator measured at that batch (null: never within the batches)."""
    out = []
    for h, k in sorted({(r["H"], r["K"]) for r in rows}):
        at = {(r["estimator"], r["batch"]): r["rel_mse"] for r in rows if r["H"] == h and r["K"] == k}
        batches = sorted({b for _, b in at})
        for low in LOW_BIAS:
            first = None
            for b in batches:
                rivals = [at[(t, b)] for t in TRUNCATED if (t, b) in at]
                if (low, b) in at and rivals and at[(low, b)] < min(rivals):
                    first = b
                    break
            best = {
                b: min((t for t in TRUNCATED if (t, b) in at), key=lambda t: at[(t, b)], default=None)
                for b in batches
            }
            out.append(
                {"H": h, "K": k, "estimator": low, "first_batch_better": first, "best_truncated": best}
            )
    return out


def scaling(args: argparse.Namespace, out: Path) -> None:
    names = [n for n in (*LOW_BIAS, *TRUNCATED, "none") if n in args.estimators or n in SCALING_ONLY]
    rows = [
        batch_mse(h, k, name, b, reps=args.reps)
        for h in args.scaling_horizons
        for k in args.scaling_lags
        for name in names
        for b in args.batches
    ]
    result = {"rows": rows, "crossing": crossings(rows)}
    (out / "scaling.json").write_text(json.dumps(result, indent=1))
    plot_scaling(rows, out / "scaling.png")
    print(json.dumps(result))


def plot_scaling(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["H"], r["K"]) for r in rows})
    fig, axes = plt.subplots(1, len(cells), figsize=(4 * len(cells), 3.6), squeeze=False)
    for ax, (h, k) in zip(axes[0], cells):
        for name in sorted({r["estimator"] for r in rows}):
            pts = sorted(
                (r["batch"], r["rel_mse"]) for r in rows if (r["H"], r["K"], r["estimator"]) == (h, k, name)
            )
            style = "-" if name in LOW_BIAS else ":"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("samples per step B")
        ax.set_ylabel("relative MSE of the batch gradient")
        ax.set_title(f"H = {h}, K = {k}")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horizons", type=int, nargs="+", default=[4, 12, 64, 256])
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1, 4])
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS))
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--out", default="outputs/bench/exact_gradient")
    parser.add_argument("--scaling", action="store_true", help="only the batch-size scaling study")
    parser.add_argument("--scaling-horizons", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--scaling-lags", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    if args.scaling:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        return scaling(args, out)
    rows = [
        measure(h, k, name, samples=args.samples)
        for h in args.horizons
        for k in args.lags
        for name in args.estimators
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "exact_gradient.png")
    print(json.dumps(rows))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lags = sorted({r["K"] for r in rows})
    fig, axes = plt.subplots(2, len(lags), figsize=(4 * len(lags), 7), squeeze=False)
    for j, k in enumerate(lags):
        for name in sorted({r["estimator"] for r in rows}):
            pts = sorted(
                (r["H"], r["bias"], r["var_per_sample"])
                for r in rows
                if r["K"] == k and r["estimator"] == name
            )
            hs = [p[0] for p in pts]
            axes[0][j].plot(hs, [p[1] for p in pts], marker="o", label=name)
            axes[1][j].plot(hs, [p[2] for p in pts], marker="o", label=name)
        for i, ylabel in enumerate(["relative bias", "variance per sample / |grad J|^2"]):
            axes[i][j].set_xscale("log", base=2)
            axes[i][j].set_yscale("log")
            axes[i][j].set_xlabel("horizon H")
            axes[i][j].set_ylabel(ylabel)
            axes[i][j].set_title(f"lag K = {k}")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
