"""Loading the HF policy and computing per-token logprobs the way the engine samples.

The engine returns ``processed_logprobs``: log-softmax of ``logits / temperature`` (after
top-p / top-k, which the default recipes leave off). ``token_logprobs`` computes exactly
that, so behaviour and trainer logprobs are comparable token by token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from modules.config.resources import build_command, is_hub_id


def load_policy(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if is_hub_id(path):  # e.g. "Qwen/Qwen2.5-0.5B-Instruct": transformers resolves it
        return AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32
        ), AutoTokenizer.from_pretrained(str(path))
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no model at {path}: build it first with {build_command(path)}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def build_policy(path: str | Path, gradient_checkpointing: bool = False, lora: Any = None) -> tuple[Any, Any]:
    """The trainable policy: dropout off for good, optionally checkpointed per decoder layer,
    optionally with LoRA adapters (``modules/policy/lora.py``), in train mode."""
    policy, tokenizer = load_policy(path)
    disable_dropout(policy)  # on-policy, the ratio must be exactly 1
    if gradient_checkpointing:  # each decoder layer's activations recomputed in backward
        policy.gradient_checkpointing_enable({"use_reentrant": False})
    if lora is not None and lora.enabled:
        policy = lora.wrap(policy)
    policy.train()
    return policy, tokenizer


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each next token: ``out[:, t] = log p(input_ids[:, t+1] | input_ids[:, :t+1])``.

    Returns ``(logp [B, T-1], entropy [B, T-1] or None)``; entropy is of the same tempered
    distribution and carries no gradient. One padded forward; the trainer's own passes use the
    configured layout (``modules.policy.packing``), which returns the same values.
    """
    from modules.policy.packing import PaddedForward

    return PaddedForward()(model, input_ids, attention_mask, temperature, with_entropy)


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off for good (RL forward passes run in train mode): with it, the trainer's
    logprobs of the engine's own samples would be noisy and the on-policy ratio != 1."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for name in ("attention_dropout", "dropout", "hidden_dropout"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The HF state dict the engine loads (tied ``lm_head`` omitted: vLLM ties it itself).
    Under LoRA: the base with the adapters merged in (``modules.policy.lora.merged_weights``)."""
    from modules.policy.lora import is_lora, merged_weights

    sd = merged_weights(model) if is_lora(model) else model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    return sd
