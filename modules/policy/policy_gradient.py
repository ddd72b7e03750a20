"""The policy-gradient LightningModule: the policy, its loss, and the metrics users read.

    python train.py recipe=sync_grpo      # GRPO
    python train.py recipe=ppo            # the same module with a critic (module/critic=value_model)

One class for the PPO-clip family: GRPO, DAPO and PPO differ in the loss parts, the advantage
estimator and the critic they are given (``conf/algo``, ``conf/module``), never in a flag here.

The module owns the HF policy and computes response-token logprobs with the sampling
temperature (the engine returns logprobs of the tempered distribution). It pulls each rollout
batch itself (``training_step(dataloader_iter)``: one item = the rollout batch's optimizer
steps), so that Lightning never prefetches a rollout batch generated with weights that are
about to change, and it computes the extra passes the loss asks for before the batch's first
update: pi_old for a decoupled anchor (``PolicyLoss.needs_old_logprobs``) and the current
logprobs of samples the ``Recompute`` staleness policy flagged. The loss is a
``modules.algo.losses.PolicyLoss`` (``algo.loss`` in the config).

Work it skips: pi_old is computed once per sample, not once per epoch, and never for the
rollout batch's first minibatch, whose training forward runs with exactly the pre-update
weights (its detached logprobs *are* pi_old). With the default bypass anchor and one
minibatch no extra pass runs at all. The forward layout (``module.forward``: packed by
default) is in ``modules/policy/packing.py``; the per-step time breakdown in ``modules/callbacks/step_timer.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from modules.algo.kl_reward import KLRewardPenalty
from modules.algo.losses import PolicyLoss, batch_counts
from modules.config.errors import check
from modules.policy.checkpoint_rng import rng_states, set_rng_states
from modules.policy.critic import Critic
from modules.policy.hf_policy import build_policy, load_policy, named_weights
from modules.policy.lora import LoRA, adapters_off, check_resume, is_lora
from modules.policy.microbatch import MicroBatched
from modules.policy.old_logprobs import OldLogprobs
from modules.policy.packing import PackedForward
from modules.policy.ranks import all_ranks_finite, reduce_over_ranks, sum_over_ranks
from modules.policy.schedules import optimizers
from modules.policy.sharding import full_weights, is_sharded, unshard


class NonFiniteLossError(RuntimeError):
    """Too many consecutive training steps with NaN/inf logprobs or loss."""


class PolicyGradientModule(OldLogprobs, L.LightningModule):
    needs_engine = True  # trains on rollouts: train.py places, checks and starts an engine

    def __init__(
        self,
        model_path: str,
        loss: PolicyLoss,
        optimizer: partial,
        temperature: float = 1.0,
        scheduler: partial | None = None,
        ref_model_path: str | None = None,
        max_consecutive_skips: int = 3,
        kl_reward: KLRewardPenalty | None = None,
        forward: Any = None,
        micro_batch_size: int | None = None,
        gradient_checkpointing: bool = False,
        critic: Critic | None = None,
        lora: LoRA | None = None,
    ) -> None:
        super().__init__()
        self.lora = lora  # model.lora: adapters on the policy (modules/policy/lora.py); None / rank 0: full
        self.critic = critic  # PPO with a value model (modules/policy/critic.py); None: group advantages
        check(
            "module.gradient_checkpointing",
            gradient_checkpointing,
            isinstance(gradient_checkpointing, bool),
            "true or false",
        )
        self.gradient_checkpointing = gradient_checkpointing
        forward = forward if forward is not None else PackedForward()
        # null: the whole minibatch in one forward; else checkpointed micro-batches (same update)
        self.forward_logprobs = (
            forward if micro_batch_size is None else MicroBatched(forward, micro_batch_size)
        )
        check("module.temperature", temperature, temperature > 0, "a float > 0")
        self.kl_reward = kl_reward or KLRewardPenalty()
        check(
            "module.ref_model_path",
            ref_model_path,
            not (loss.needs_reference or self.kl_reward.enabled) or ref_model_path is not None,
            "a model path when algo.loss.kl_coef > 0 or algo.kl_reward.coef > 0 (the KL needs a "
            "reference policy)",
        )
        check(
            "algo.kl_reward.coef",
            self.kl_reward.coef if critic is not None else 0,
            critic is None or not self.kl_reward.enabled,
            "0 with module.critic (the critic reads the outcome reward; use algo.loss.kl_coef)",
        )
        check(
            "module.max_consecutive_skips", max_consecutive_skips, max_consecutive_skips >= 1, "an int >= 1"
        )
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.ref_model_path = ref_model_path
        self.ref_policy: Any = None
        self.model_path = str(model_path)
        self.loss_fn = loss
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.temperature = temperature
        self.policy: Any = None
        self.tokenizer: Any = None
        # Policy version = number of weight syncs to the engine; checkpointed.
        self.policy_version = 0
        self.samples_trained = 0
        self.last_weight_sync_s = 0.0
        self.last_weight_verify_s = 0.0  # the engine's scoring pass that checks the last sync
        self.last_weight_sync_diff = 0.0  # engine vs trainer logprobs after the last sync
        self.last_rank_weight_diff = 0.0  # DDP: weight fingerprint spread across ranks
        self.last_kl_reward_penalty = 0.0  # mean KL reward penalty of the current rollout batch
        self._t_start: float | None = None
        self._samples_at_start = 0
        self._reward_ema: float | None = None  # progress-bar smoothing only (not checkpointed)
        self._wait_s = 0.0
        self._steps: list[dict[str, Any]] = []  # optimizer steps left of the current rollout batch
        self.current_batch: dict[str, Any] | None = None  # the step's minibatch (WeightSync reads it)
        self.init_old_logprobs()
        self.step_times: dict[str, float] = {}  # this step's wait / prepare / forward seconds

    def configure_model(self) -> None:
        if self.policy is None:
            self.policy, self.tokenizer = build_policy(
                self.model_path, self.gradient_checkpointing, self.lora
            )
        if self.critic is not None:
            self.critic.build(self.gradient_checkpointing)
        # LoRA on the reference's weights: the reference is the policy with adapters off
        base_is_ref = self.lora is not None and self.lora.enabled and self.ref_model_path == self.model_path
        if self.ref_model_path and self.ref_policy is None and not base_is_ref:
            ref, _ = load_policy(self.ref_model_path)
            ref.eval().requires_grad_(False)
            object.__setattr__(self, "ref_policy", ref)  # frozen: not a submodule, not checkpointed

    # ------------------------------------------------------------------ training
    def training_step(self, dataloader_iter: Iterator) -> torch.Tensor:
        if self._t_start is None:
            self._t_start = time.perf_counter()
            self._samples_at_start = self.samples_trained  # nonzero after a resume
        if is_sharded(self.policy):  # FSDP: gathered on every rank; forwards until backward are local
            unshard(self.policy)
        t0 = time.perf_counter()
        wait = prepare = 0.0
        if not self._steps:
            steps, _, _ = next(dataloader_iter)
            t1 = time.perf_counter()
            wait = t1 - t0
            self._wait_s += wait
            self._steps = self.prepare_rollout_batch(move_data_to_device(steps, self.device))
            if self.critic is not None:
                self.critic.new_rollout_batch()
            prepare = time.perf_counter() - t1
        t2 = time.perf_counter()
        batch = self._steps.pop(0)
        self.current_batch = batch  # read by WeightSync.on_train_batch_end
        logp, entropy = self.forward_logprobs(
            self.policy, batch["input_ids"], batch["attention_mask"], self.temperature, with_entropy=True
        )
        self._complete_old_logprobs(batch, logp)
        mask = batch["loss_mask"]
        behavior = batch["behavior_logprobs"]
        extra = {"old_logp": batch["old_logprobs"]} if "old_logprobs" in batch else {}
        if self.loss_fn.needs_reference:
            extra["ref_logp"] = self.ref_logprobs(batch)
        totals, world = self._global_counts(mask)
        advantages, value_loss = batch["advantages"], None
        if self.critic is not None:  # per-token V-trace advantages and the value loss
            advantages, value_loss, critic_metrics = self.critic.step(
                batch, logp, partial(sum_over_ranks, world=world)
            )
            batch["critic_advantages"] = advantages
        loss, metrics = self.loss_fn(
            logp,
            behavior,
            advantages,
            mask,
            weights=batch["weights"],
            staleness=batch["staleness"],
            totals=totals,
            world_size=world,
            **extra,
        )
        if value_loss is not None:  # token-mean over the global batch, like the policy term
            loss = loss + value_loss.sum() * world / totals[0].clamp_min(1).to(value_loss.dtype)
            metrics.update(critic_metrics)
        self.samples_trained += int(batch["num_samples"])
        finite = all_ranks_finite(loss, logp * mask, self.device, world)  # waits for the device
        self.step_times = {"wait": wait, "prepare": prepare, "forward": time.perf_counter() - t2}
        if not finite:
            return self._skip_step(loss)
        self.consecutive_skips = 0
        self._log_step(batch, loss, metrics, entropy, mask)
        return loss

    def _global_counts(self, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The loss normalisers (tokens, sequences) summed over DDP ranks, and the rank count:
        each rank's loss is then its share of the global aggregate (``losses.aggregate``)."""
        counts = batch_counts(mask).double()
        world = self._trainer.world_size if self._trainer is not None else 1
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(counts)
        return counts, world

    def _skip_step(self, loss: torch.Tensor) -> None:
        """Non-finite logprobs or loss: skip the optimizer step (return None), count it, and
        stop with a clear error after ``max_consecutive_skips`` in a row."""
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.log("train/skipped_steps", float(self.skipped_steps), on_step=True, batch_size=1)
        if self.consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteLossError(
                f"{self.consecutive_skips} consecutive steps had non-finite logprobs or loss "
                f"(last loss {loss.item()}); module.max_consecutive_skips={self.max_consecutive_skips}"
            )
        return None

    def _log_step(
        self,
        batch: dict[str, Any],
        loss: torch.Tensor,
        metrics: dict[str, torch.Tensor],
        entropy: torch.Tensor,
        mask: torch.Tensor,
    ) -> None:
        bs = int(mask.shape[0])
        log = partial(self.log, on_step=True, on_epoch=False, batch_size=bs)
        values = {"train/loss": loss.detach()}
        values.update({k if "/" in k else f"train/{k}": v for k, v in metrics.items()})  # is/*, mismatch/*
        values["train/entropy"] = (entropy * mask).sum() / mask.sum().clamp_min(1)
        adv = batch.get("critic_advantages", batch["advantages"])  # per token with a critic
        per_token = adv.dim() > 1
        values["train/advantage_abs_mean"] = (
            (adv.abs() * mask).sum() / mask.sum() if per_token else adv.abs().mean()
        )
        if self.kl_reward.enabled:
            values["train/kl_reward_penalty"] = self.last_kl_reward_penalty
        if self._trainer is not None and self._trainer.world_size > 1:
            values = reduce_over_ranks(values, self.device, self._trainer.world_size)
        for k, v in values.items():
            log(k, v)
        stats = batch.get("rollout_stats") or {}
        for k, v in stats.items():
            log(k, float(v), prog_bar=k == "rollout/buffer_size")
        if "train/reward_mean" in stats:  # one batch's mean is noisy: show a trend on the bar
            r = float(stats["train/reward_mean"])
            self._reward_ema = r if self._reward_ema is None else 0.9 * self._reward_ema + 0.1 * r
            log("train/reward_ema", self._reward_ema, prog_bar=True)
        log("rollout/policy_version", float(self.policy_version))
        # Staleness from the data itself: current version minus each sample's oldest token.
        big = torch.iinfo(torch.long).max
        versions = torch.where(
            mask > 0, batch["token_versions"], torch.full_like(batch["token_versions"], big)
        )
        has_tokens = mask.sum(dim=1) > 0
        oldest = torch.where(has_tokens, versions.min(dim=1).values, batch["policy_versions"])
        staleness = (self.policy_version - oldest).float()
        log("rollout/staleness_mean", staleness.mean(), prog_bar=True)
        log("rollout/staleness_max", staleness.max())
        elapsed = max(time.perf_counter() - (self._t_start or time.perf_counter()), 1e-9)
        log("perf/samples_per_s", (self.samples_trained - self._samples_at_start) / elapsed, prog_bar=True)
        log("perf/wall_s", elapsed)
        log("perf/samples_total", float(self.samples_trained))
        log("perf/trainer_idle_frac", self._wait_s / elapsed)
        log("perf/weight_sync_s", self.last_weight_sync_s)
        log("perf/weight_verify_s", self.last_weight_verify_s)
        log("perf/weight_sync_max_abs_diff", self.last_weight_sync_diff)
        if self._trainer is not None and self._trainer.world_size > 1 and not is_sharded(self.policy):
            log("perf/rank_weight_max_diff", self.last_rank_weight_diff)

    @property
    def needs_old_logprobs(self) -> bool:
        return self.loss_fn.needs_old_logprobs

    @torch.no_grad()
    def ref_logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        """The reference policy's logprobs of the batch's tokens."""
        if self.ref_policy is None and not is_lora(self.policy):  # LoRA: the adapters-off base
            raise RuntimeError("no reference policy: module.ref_model_path is null")
        ref = self.policy if self.ref_policy is None else self.ref_policy.to(self.device)
        with adapters_off(ref):
            logp, _ = self.forward_logprobs(
                ref, batch["input_ids"], batch["attention_mask"], self.temperature
            )
        return logp

    @torch.no_grad()
    def old_logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        """The current weights' logprobs (pi_old before this rollout batch's updates)."""
        ids = batch["input_ids"].to(self.device)
        mask = batch["attention_mask"].to(self.device)
        logp, _ = self.forward_logprobs(self.policy, ids, mask, self.temperature)
        return logp

    # ------------------------------------------------------------------ weights
    def weights_for_engine(self) -> dict[str, torch.Tensor]:
        """Under FSDP a collective: every rank gathers the full tensors (modules/policy/sharding.py)."""
        return full_weights(self.policy) if is_sharded(self.policy) else named_weights(self.policy)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["asyncrl"] = {
            "policy_version": self.policy_version,
            "samples_trained": self.samples_trained,
            "rng": rng_states(),  # rank 0's; every rank resumes from them
            "lora": self.lora.spec() if self.lora is not None and self.lora.enabled else None,
            "old_logprobs": self.part_trained_old(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("asyncrl", {})
        check_resume(state.get("lora"), self.lora)  # before the state dict: names the field
        self.policy_version = int(state.get("policy_version", 0))
        self.samples_trained = int(state.get("samples_trained", 0))
        if state.get("rng"):
            set_rng_states(state["rng"])
        self.resume_old_logprobs(state.get("old_logprobs"))
        self.configure_model()

    def configure_optimizers(self) -> Any:
        params: Any = [p for p in self.policy.parameters() if p.requires_grad]  # LoRA: adapters
        if self.critic is not None:  # its own parameter group and learning rate
            params = [{"params": list(params)}, {"params": self.critic.parameters(), "lr": self.critic.lr}]
        return optimizers(params, self.optimizer_factory, self.scheduler_factory)
