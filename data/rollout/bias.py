"""Completion-time bias: what the trainer sees versus what the engine was asked for.

A trainer that consumes whatever finishes first sees short (easy) responses early and long
(hard) ones late and staler, or never (dropped). ``BiasTracker`` counts, per difficulty level
and per length bucket, the samples *issued* (at submission), *generated* (every finished
response, trained or not) and *trained*, plus the staleness of trained samples per length
bucket. Metrics (cumulative since the start of the run):

* ``bias/len_kl_trained_vs_issued``: KL(trained || generated) over length buckets, in nats;
  0 when every generated response is trained in proportion (sync mode). A length is only
  known once a response is generated, so the reference is every generated response (trained
  or not), the closest observable stand-in for what was issued.
* ``bias/level_kl_trained_vs_issued``: the same over difficulty levels, against issued.
* ``bias/staleness_long_minus_short``: mean staleness of trained samples in the longest
  occupied length bucket minus the shortest.
* ``bias/trained_frac_level<k>``: share of trained samples per difficulty level.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from typing import Any

from data.rollout.experience import Experience

LENGTH_EDGES = (8, 16, 32, 64, 128)  # bucket i holds lengths < LENGTH_EDGES[i]; last is the rest


def length_bucket(n: int) -> int:
    for i, edge in enumerate(LENGTH_EDGES):
        if n < edge:
            return i
    return len(LENGTH_EDGES)


def kl(p: Counter, q: Counter, eps: float = 1e-3) -> float:
    """KL(p || q) between two count histograms, smoothed so empty buckets stay finite."""
    keys = set(p) | set(q)
    if not keys or not sum(p.values()) or not sum(q.values()):
        return 0.0
    pn, qn = sum(p.values()) + eps * len(keys), sum(q.values()) + eps * len(keys)
    return sum(
        ((p[k] + eps) / pn) * math.log(((p[k] + eps) / pn) / ((q[k] + eps) / qn)) for k in keys if p[k] > 0
    )


class BiasTracker:
    """Thread-safe: completion callbacks count generated responses while the trainer thread
    reads the metrics or a checkpoint snapshots the counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.issued_levels: Counter = Counter()
        self.generated_lengths: Counter = Counter()
        self.trained_lengths: Counter = Counter()
        self.trained_levels: Counter = Counter()
        self.staleness_sum: Counter = Counter()

    def _counters(self) -> dict[str, Counter]:
        return {
            "issued_levels": self.issued_levels,
            "generated_lengths": self.generated_lengths,
            "trained_lengths": self.trained_lengths,
            "trained_levels": self.trained_levels,
            "staleness_sum": self.staleness_sum,
        }

    def state_dict(self) -> dict[str, list[list]]:
        """Plain lists of [key, count] (keys may be None), so checkpoints load with weights_only."""
        with self._lock:
            return {name: [[k, v] for k, v in c.items()] for name, c in self._counters().items()}

    def load_state_dict(self, state: dict[str, list[list]]) -> None:
        with self._lock:
            for name, counter in self._counters().items():
                counter.clear()
                counter.update({k: v for k, v in state.get(name, [])})

    def on_issue(self, level: int | None, n: int = 1) -> None:
        """``n`` samples of ``level`` issued (negative: taken back, to be issued again)."""
        with self._lock:
            self.issued_levels[level] += n

    def on_generated(self, exp: Experience) -> None:
        with self._lock:
            self.generated_lengths[length_bucket(len(exp.response_ids))] += 1

    def on_trained(self, exps: list[Experience], sign: int = 1) -> None:
        """Count ``exps`` as trained (``sign=-1``: a checkpoint gives the batch back)."""
        with self._lock:
            for e in exps:
                b = length_bucket(len(e.response_ids))
                self.trained_lengths[b] += sign
                self.trained_levels[e.difficulty] += sign
                self.staleness_sum[b] += sign * e.staleness

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return self._metrics()

    def _metrics(self) -> dict[str, float]:
        out = {
            "bias/len_kl_trained_vs_issued": kl(self.trained_lengths, self.generated_lengths),
            "bias/level_kl_trained_vs_issued": kl(self.trained_levels, self.issued_levels),
        }
        occupied = sorted(b for b, n in self.trained_lengths.items() if n)
        if len(occupied) >= 2:
            lo, hi = occupied[0], occupied[-1]
            out["bias/staleness_long_minus_short"] = (
                self.staleness_sum[hi] / self.trained_lengths[hi]
                - self.staleness_sum[lo] / self.trained_lengths[lo]
            )
        total = sum(self.trained_levels.values())
        for level, n in sorted(self.trained_levels.items(), key=lambda kv: str(kv[0])):
            if level is not None:
                out[f"bias/trained_frac_level{level}"] = n / total
        return out


def reweight_by_level(chosen: list[Any], trained_levels: dict, issued_levels: dict) -> None:
    """Sampling-probability weighting against completion-time bias (``rollout.reweight``): a
    group's weight is its level's share of issued samples over its level's share of everything
    trained so far (this batch included; ``trained_levels`` is updated). Under-trained (slow)
    levels get weight > 1 when they do arrive; averaged over the run the weights are 1, and the
    weighted level mix of trained samples tracks the issued mix. Batch-to-batch loss scale
    varies accordingly. ``chosen``: the batch's ready groups (``.level``, ``.exps``)."""
    for r in chosen:
        trained_levels[r.level] = trained_levels.get(r.level, 0) + len(r.exps)
    issued = {lv: n for lv, n in issued_levels.items() if lv is not None}
    total_issued, total_trained = sum(issued.values()), sum(trained_levels.values())
    if not total_issued:
        return
    for r in chosen:
        share_trained = trained_levels[r.level] / total_trained
        w = (issued.get(r.level, 0) / total_issued) / share_trained
        for e in r.exps:
            e.weight *= w
