"""Sizes no run can hold: what the rollout would keep in memory, or queue on the engine,
estimated from the config before anything is built (``validate`` calls ``check_budget``).

    python train.py data.train_size=10000000000     # refused: ~9.3 TiB of prompt rows, 20 GiB here

The estimates are deliberately rough (an order of magnitude is what tells a typo from a
setting): a token held in an experience costs ``BYTES_PER_TOKEN`` (ids, behaviour logprobs and
versions as Python lists), a prompt row ``BYTES_PER_ROW``. A value passes while its term fits in
a quarter of the memory available now; requests in flight pass while they are at most
``QUEUE_FACTOR`` times what the engine generates at once (more only waits in its queue,
growing stale).
"""

from __future__ import annotations

import math

from omegaconf import DictConfig

from modules.config.errors import check

BYTES_PER_TOKEN = 100
BYTES_PER_ROW = 1024
QUEUE_FACTOR = 4
DEFAULT_P, DEFAULT_G = 16, 8


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


def check_budget(cfg: DictConfig, available_bytes: int | None = None) -> None:
    import psutil

    ram = available_bytes or psutil.virtual_memory().available
    room = ram / 4
    data, rollout, engine = cfg.data, cfg.rollout, cfg.engine
    for field in ("train_size", "eval_size"):
        n = _int(data.get(field))
        if n is not None:
            need = n * BYTES_PER_ROW
            check(
                f"data.{field}",
                n,
                need <= room,
                f"at most {int(room // BYTES_PER_ROW):,} rows here "
                f"(about {_gib(need)} of prompt rows; {_gib(ram)} of memory available)",
            )
    p, g, tokens = (
        _int(rollout.get("prompts_per_step")),
        _int(rollout.get("group_size")),
        _int(engine.get("max_model_len")),
    )
    if p is None or g is None or tokens is None:
        return  # their constructors name them
    per_group = g * tokens * BYTES_PER_TOKEN
    need = p * per_group
    blame = "prompts_per_step" if p / DEFAULT_P >= g / DEFAULT_G else "group_size"
    check(
        f"rollout.{blame}",
        rollout[blame],
        need <= room,
        f"a value whose rollout batch fits in memory "
        f"(P x G = {p * g:,} responses of up to {tokens} tokens: about {_gib(need)}; {_gib(ram)} available)",
    )
    samples = _int(data.get("eval_samples"))
    eval_size = _int(data.get("eval_size")) or 0
    if samples is not None:
        need = eval_size * samples * tokens * BYTES_PER_TOKEN
        check(
            "data.eval_samples",
            samples,
            need <= room,
            f"a count whose evaluation fits in memory "
            f"({eval_size:,} prompts x {samples:,} samples of up to {tokens} tokens: about {_gib(need)})",
        )
    slots = (_int(engine.get("max_num_seqs")) or 256) * (_int(engine.get("replicas")) or 1)
    inflight = rollout.get("max_inflight")
    if _int(inflight) is not None:
        check(
            "rollout.max_inflight",
            inflight,
            inflight * g <= QUEUE_FACTOR * slots,
            f"auto or at most {QUEUE_FACTOR * slots // g} groups ({QUEUE_FACTOR} x engine.max_num_seqs x "
            f"engine.replicas = {QUEUE_FACTOR * slots} requests of G = {g}; more only queue)",
        )
    alpha = rollout.get("over_provision")
    if isinstance(alpha, int | float) and not isinstance(alpha, bool) and math.isfinite(alpha):
        check(
            "rollout.over_provision",
            alpha,
            alpha * p * g <= QUEUE_FACTOR * slots + p * g,
            f"auto or at most {(QUEUE_FACTOR * slots + p * g) / (p * g):.2f} (alpha P G requests in flight: "
            f"at most a batch more than {QUEUE_FACTOR} x the engine's {slots} slots)",
        )
    capacity = rollout.get("buffer_capacity")
    k = rollout.get("max_staleness")
    if _int(capacity) is not None:
        need = capacity * per_group
        check(
            "rollout.buffer_capacity",
            capacity,
            need <= room,
            f"auto or a count that fits in memory (about {_gib(need)} for {capacity:,} groups)",
        )
    elif capacity == "auto" and _int(k) is not None:
        need = p * (k + 1) * per_group
        check(
            "rollout.max_staleness",
            k,
            need <= room,
            f"a bound whose automatic buffer fits in memory "
            f"(P (K + 1) = {p * (k + 1):,} groups: about {_gib(need)}; null for unbounded)",
        )
