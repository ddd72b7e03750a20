"""Pushing the policy to the rollout engine after each rollout batch, and checking it arrived.

``WeightSync`` (``callbacks.weight_sync`` in the config) owns the push, its verify pass and the
delayed sync (``lag``) used by the controlled-lag experiments.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Any

import lightning as L
import torch

from modules.policy.lora import adapters_off, functional_target
from modules.policy.sharding import gathered, is_sharded

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """After a sync the engine's logprobs differ from the trainer's."""


# Default verify tolerance (max |engine - trainer| logprob over the probe) by the engine's dtype;
# the trainer computes in float32. float32 engines agree to ~1e-5 here. A bfloat16 / float16
# engine differs by rounding, so its bound catches only gross sync bugs (a missing or stale
# tensor moves logprobs by whole nats), not a slightly wrong version. ``engine.dtype=auto``
# depends on the checkpoint, so it needs an explicit tolerance.
# float32: vLLM-CPU and torch kernels differ by ~1e-5 per token logprob at the warm start and
# by 1.6e-4 after 39 versions at lr 2e-3 (larger logits; measured 2026-12-02), while a sync that
# serves the wrong version differs by far more. bfloat16: the per-sync gap grew from 0.02-0.18
# at the warm start to 0.33 and 0.42 over 60 steps at lr 2e-3 (two runs, 2026-12-02), so 1.0;
# float16 is not measured. docs/estimators.md.
VERIFY_TOLERANCE = {"float32": 1e-3, "bfloat16": 1.0, "float16": 0.1}


# A probe this many times over the tolerance (or non-finite) fails the sync at once; below it,
# two more sequences decide (WeightSync's docstring).
OUTLIER_FACTOR = 10
# Fixed probes before the first trained sequence exists (train start, resume): three, so a
# kernel outlier on one of them does not block a resume.
START_PROBES = ("12%5=10,5,0.", "47%6=5,4,3.", "9%4=1,0.")


def verify_tolerance(tolerance: float | None, engine_dtype: str) -> float:
    """The configured tolerance, or the engine dtype's default when it is null."""
    return VERIFY_TOLERANCE[engine_dtype] if tolerance is None else float(tolerance)


class WeightSync(L.Callback):
    """Push the policy to the engine after the last minibatch of each rollout batch.

    Also once at train start, so a resumed run's engine serves the checkpoint's weights.
    With ``verify`` the engine then scores one trained sequence and its logprobs must match
    the trainer's within ``tolerance`` (one prefill per sync; a silent sync bug, e.g. a stale
    tied ``lm_head``, otherwise shows up only as a slowly drifting ``train/kl_behavior``).
    When that sequence exceeds the tolerance by less than ``OUTLIER_FACTOR``x (finite), two more
    sequences are scored and the sync fails if two of the three exceed it: a wrong or stale
    sync moves every sequence (one version stale at lr 5e-3: 0.08-1 nats on each of 96), while
    vLLM-CPU's float32 kernels can differ from torch's by ~1e-3 on a single sequence of a peaked
    policy (measured: 1.17e-3 on one probe at version 58 of a LoRA run at lr 5e-3, with the
    trainer's float32 and float64 forwards agreeing to 6e-5 and 64 other sequences of that
    policy within 1.1e-4). ``perf/weight_sync_max_abs_diff`` logs the first sequence's gap.

    ``lag`` K > 0 is a delayed sync, for off-policy experiments: when the trainer reaches
    version v the engine gets the weights of version v - K (kept on rank 0's CPU, K + 1 copies,
    also in every checkpoint), so with ``rollout=sync`` every trained token is exactly K versions
    old once v >= K (the first K batches come from the starting weights, and no sync is sent
    while the served version does not change). Lag is then an experimental variable rather
    than an emergent one. The delay line is checkpointed; at train end the engine gets the
    current weights, so the final evaluation and saved model describe the trained policy.
    """

    def __init__(
        self, verify: bool = True, tolerance: float | None = None, lag: int = 0, engine_dtype: str = "float32"
    ) -> None:
        from modules.config.errors import check

        check("callbacks.weight_sync.lag", lag, isinstance(lag, int) and lag >= 0, "an int >= 0")
        check(
            "callbacks.weight_sync.tolerance",
            tolerance,
            tolerance is None or tolerance > 0,
            "null or a float > 0 (the engine's logprobs never match the trainer's to the last bit)",
        )
        check(
            "callbacks.weight_sync.tolerance",
            tolerance,
            tolerance is not None or engine_dtype in VERIFY_TOLERANCE,
            f"a number when engine.dtype={engine_dtype} (null picks it only for "
            f"{', '.join(VERIFY_TOLERANCE)})",
        )
        self.verify = verify
        self.tolerance = verify_tolerance(tolerance, engine_dtype)
        self.lag = lag
        self.last_probe: list[int] | None = None
        self.spare_probes: list[list[int]] = []  # scored only when last_probe exceeds the tolerance
        # (version, CPU weights) of the last lag + 1 versions; the oldest is what the engine serves
        self.delay_line: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.served_version: int | None = None  # what the engine serves (rank 0; None: nothing yet)

    def _delayed(self, weights: dict[str, torch.Tensor], version: int) -> tuple[dict[str, torch.Tensor], int]:
        """The weights and version the engine should serve when the trainer is at ``version``.
        A version already in the line keeps its weights (a resume mid rollout batch re-syncs
        the checkpoint's version with partly updated weights)."""
        if self.lag == 0:
            return weights, version
        line = [(v, w) for v, w in self.delay_line if v <= version]
        if not line or line[-1][0] != version:
            line.append((version, {k: t.detach().to("cpu", copy=True) for k, t in weights.items()}))
        self.delay_line = [(v, w) for v, w in line if v >= version - self.lag]
        return self.delay_line[0][1], self.delay_line[0][0]

    def _sync(
        self, trainer: L.Trainer, pl_module: L.LightningModule, version: int, flush: bool = False
    ) -> None:
        pl_module.policy_version = version
        sharded = is_sharded(pl_module.policy)  # FSDP: one copy of each weight, nothing to compare
        if self.verify and trainer.world_size > 1 and not sharded:
            self._check_ranks_agree(pl_module, version)
        if trainer.global_rank != 0 and not sharded:
            return  # DDP: rank 0 owns the engine; the weights are the same on every rank
        weights = pl_module.weights_for_engine()  # FSDP: a collective, every rank gathers
        # FSDP: the verify forward is a collective too: every rank gathers, rank 0 runs it
        with gathered(pl_module.policy) if self.verify and self.last_probe else nullcontext():
            if trainer.global_rank == 0:
                self._push(trainer, pl_module, weights, version, flush)

    def _push(
        self, trainer: L.Trainer, pl_module: L.LightningModule, weights: dict, version: int, flush: bool
    ) -> None:
        """Rank 0: send ``weights`` (or the delayed ones) to the engine and verify them."""
        trainer.datamodule.set_trainer_version(version)  # staleness is counted from it
        served, served_version = (weights, version) if flush else self._delayed(weights, version)
        if served is not weights and served_version == self.served_version:
            pl_module.last_weight_sync_s = 0.0  # a delayed sync whose served version did not
            return  # move: the engine has it already
        self.served_version = served_version
        pl_module.last_weight_sync_s = trainer.datamodule.sync_weights(served, served_version)
        if self.verify and self.last_probe:
            t0 = time.perf_counter()
            delayed = None if served is weights else served
            diff = self._max_diff(trainer, pl_module, self.last_probe, delayed)
            pl_module.last_weight_sync_diff = diff
            diffs = [diff]
            outlier = diff <= OUTLIER_FACTOR * self.tolerance  # NaN / inf / nats: never an outlier
            if not diff <= self.tolerance and outlier:  # one sequence off, or most? (docstring)
                diffs += [self._max_diff(trainer, pl_module, p, delayed) for p in self.spare_probes]
                log.warning(
                    "weight sync %d: the probe differs by %.2e (> %.0e); other sequences: %s",
                    served_version,
                    diff,
                    self.tolerance,
                    ", ".join(f"{d:.2e}" for d in diffs[1:]) or "none",
                )
            pl_module.last_weight_verify_s = time.perf_counter() - t0
            bad = sum(not d <= self.tolerance for d in diffs)  # NaN counts as bad
            if bad > (len(diffs) - 1) // 2:  # 3 scored: two bad fail; 1 or 2 scored: any
                raise WeightSyncError(
                    f"after syncing version {served_version} the engine's logprobs differ from the "
                    f"trainer's by {', '.join(f'{d:.2e}' for d in diffs)} on {len(diffs)} sequence(s) "
                    f"(tolerance {self.tolerance:.0e}; one sequence up to {OUTLIER_FACTOR}x is "
                    "allowed when two others pass)"
                )

    def state_dict(self) -> dict[str, object]:
        return {"delay_line": self.delay_line} if self.lag else {}

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        self.delay_line = list(state_dict.get("delay_line", []))  # type: ignore[arg-type]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != 0:  # callback state is restored before this hook
            self.delay_line = []  # only rank 0 serves the engine

    @staticmethod
    def _check_ranks_agree(pl_module: L.LightningModule, version: int) -> None:
        """DDP: every rank must hold the weights rank 0 sends to the engine. Compares a
        float64 sum per parameter tensor across ranks (one small all-gather per sync)."""
        params = [p.detach() for p in pl_module.policy.parameters()]
        fingerprint = torch.stack([p.sum(dtype=torch.float64) for p in params])  # no fp64 copies
        gathered = pl_module.all_gather(fingerprint)  # [world, n_params]
        diff = float((gathered - gathered[0]).abs().max())
        pl_module.last_rank_weight_diff = diff
        if diff != 0.0:
            raise WeightSyncError(
                f"before syncing version {version} the DDP ranks hold different weights "
                f"(max per-tensor sum difference {diff:.3e}); the engine would serve rank 0's"
            )

    @staticmethod
    def _max_diff(
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        seq: list[int],
        served: dict[str, torch.Tensor] | None = None,
    ) -> float:
        """Max |engine - trainer| logprob over ``seq``; the trainer side computed with ``served``
        (the delayed weights the engine got) in place of the policy's own, when given."""
        from torch.func import functional_call

        from modules.policy.hf_policy import token_logprobs

        engine_lp = torch.tensor(trainer.datamodule.engine_logprobs(seq))
        seq = seq[: len(engine_lp) + 1]  # the engine scores at most max_model_len - 1 tokens
        policy = pl_module.policy
        was_training = policy.training
        policy.eval()
        with torch.no_grad():
            ids = torch.tensor([seq], device=pl_module.device)
            model = policy
            if served is not None:  # LoRA: the base with the merged weights, adapters off
                target, params = functional_target(
                    policy, {k: t.to(pl_module.device) for k, t in served.items()}
                )

                def model(*args: object, **kwargs: object) -> object:  # tied lm_head follows
                    return functional_call(target, params, args, kwargs, strict=False)

            with adapters_off(policy) if served is not None else nullcontext():
                lp, _ = token_logprobs(model, ids, torch.ones_like(ids), 1.0)
        policy.train(was_training)
        return float((lp[0].cpu() - engine_lp).abs().max())

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.last_probe is None and pl_module.tokenizer is not None:
            # No trained sequence yet: probe a fixed text, so the first sync (the checkpoint's
            # weights, after a resume) is verified too.
            first, *spare = (list(pl_module.tokenizer(t)["input_ids"]) for t in START_PROBES)
            self.last_probe, self.spare_probes = first, spare
        self._sync(trainer, pl_module, pl_module.policy_version)
        self.synced_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        batch = pl_module.current_batch
        if batch is None or not batch.get("sync_after"):
            return
        rows = [
            batch["input_ids"][i, : int(batch["attention_mask"][i].sum())].tolist()
            for i in range(3)
            if i < len(batch["input_ids"])
        ]
        self.last_probe, self.spare_probes = rows[0], rows[1:]
        self._sync(trainer, pl_module, pl_module.policy_version + 1)
        self.synced_step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # max_steps may stop mid rollout batch: sync the updates made since the last sync, so
        # the final evaluation and the saved model describe the same policy.
        if trainer.global_step != self.synced_step:
            self._sync(trainer, pl_module, pl_module.policy_version + 1, flush=True)
            self.synced_step = trainer.global_step
        elif self.lag:  # the engine serves v - K: flush (same decision on every DDP rank)
            self._sync(trainer, pl_module, pl_module.policy_version, flush=True)


def weight_sync_lag(cfg: Any) -> object:
    """``callbacks.weight_sync.lag`` (0 when unset, also without a weight-sync group)."""
    return ((cfg.get("callbacks") or {}).get("weight_sync") or {}).get("lag") or 0


def lag_needs_sync_barrier(cfg: Any) -> None:
    """Cross-field rule: a delayed sync makes the lag exact only behind the sync barrier."""
    from modules.config.errors import check
    from modules.config.schema import target_class

    lag = weight_sync_lag(cfg)
    check(
        "callbacks.weight_sync.lag",
        lag,
        lag == 0 or getattr(target_class(cfg.get("rollout")), "barrier", False),
        "0 unless rollout=sync (a delayed sync makes the lag exact only behind the barrier; "
        "partial and streaming rollouts have their own lag, bounded by rollout.max_staleness)",
    )
