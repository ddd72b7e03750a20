"""The cells of the drift grid: its arms, and a cell as the spec string ``lab.modes`` runs.

Imported by ``lab.drift_grid`` (run that: ``python -m lab.drift_grid ...``), and by the
analyses of its stored runs (``lab.detector_eval``, ``lab.k1_analysis``). A cell spec is
``sync_grpo:callbacks.weight_sync.lag=K,algo/correction=...,callbacks/drift=monitor,...``;
``cell_spec`` writes one, ``arm_of`` / ``lag_of`` / ``short`` read one back.
"""

from __future__ import annotations

# The grid's arms: the anchor, the trust region and the correction are separate factors, so
# that two arms differ in what their names say. ``bypass``: PPO clip of pi / mu (the shipped
# recipes); ``bypass_noclip``: the same surrogate without the clip (``algo/objective=reinforce``:
# sg(pi / mu) A grad log pi, no trust region; the gradient of decoupled + untruncated token_is
# without a clip); ``decoupled``: PPO clip of pi / pi_old and no behaviour weight; every other
# arm is that plus the named correction of pi_old / mu. ``none`` is the old name of ``bypass``.
ARMS = ["bypass", "bypass_noclip", "decoupled", "tis", "tseq_is", "token_is", "icepop"]
CORRECTIONS = ["none", "token_is", "tis", "tseq_is", "geo_seq_is", "icepop", "ds_seq_mask"]
MISMATCH = ["none", "tis", "mis", "icepop"]


def arm_overrides(arm: str) -> list[str]:
    """The overrides of one arm (see ``ARMS``), in the order the stored cell specs use."""
    if arm in ("none", "bypass"):
        return ["algo/correction=none"]
    if arm == "bypass_noclip":
        return ["algo/correction=none", "algo/objective=reinforce"]
    correction = "none" if arm == "decoupled" else arm
    return [f"algo/correction={correction}", "algo.loss.anchor=decoupled"]


def arm_of(spec: str) -> str:
    """The arm a cell spec runs (``cell_spec``'s inverse)."""
    parts = spec_overrides(spec)
    correction = parts.get("algo/correction", "none")
    if parts.get("algo.loss.anchor") == "decoupled":
        return "decoupled" if correction == "none" else correction
    if correction == "none":
        return "bypass_noclip" if parts.get("algo/objective") == "reinforce" else "bypass"
    return correction


def cell_spec(lag: int, arm: str, extra: list[str] | None = None, controller: bool = False) -> str:
    drift = "controller" if controller else "monitor"
    first, *rest = arm_overrides(arm)
    parts = [f"callbacks.weight_sync.lag={lag}", first, f"callbacks/drift={drift}", *rest]
    return "sync_grpo:" + ",".join([*parts, *(extra or [])])


def spec_overrides(spec: str) -> dict[str, str]:
    """A cell spec's overrides, key -> value, in order ('sync_grpo:a=1,b=2' -> {a: 1, b: 2})."""
    return dict(part.partition("=")[::2] for part in spec.partition(":")[2].split(","))


def lag_of(spec: str) -> int:
    return int(spec_overrides(spec).get("callbacks.weight_sync.lag", 0))


def short(spec: str) -> str:
    """'K=8 tis decoupled +controller' for a cell spec."""
    out = []
    for key, value in spec_overrides(spec).items():
        if key == "callbacks.weight_sync.lag":
            out.append(f"K={value}")
        elif key == "algo/correction":
            out.append(arm_of(spec))
        elif key in ("algo.loss.anchor", "algo/objective"):
            continue  # in the arm's name
        elif key == "callbacks/drift":
            out.append("+controller" if value == "controller" else "")
        else:
            out.append(f"{key}={value}")
    return " ".join(o for o in out if o)
