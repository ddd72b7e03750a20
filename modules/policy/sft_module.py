"""Supervised fine-tuning on reference responses: the warm start for the RL recipes.

    python train.py recipe=sft_warmup

Loss is next-token cross-entropy on response tokens only. Validation decodes greedily with
transformers (no engine needed) and logs the task reward as ``eval/reward_mean``, plus one
``eval/reward_level<k>`` per difficulty level. If ``model_path`` holds no model yet, a tiny
random Qwen2 is built there first from ``build`` (deterministic); with ``build`` null the
model is a pretrained one (``recipe=smollm2_sft_tools`` starts from SmolLM2-135M-Instruct),
and a missing one is refused naming the command that makes it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch

from modules.config.errors import ConfigError, check
from modules.config.resources import build_command
from modules.policy.hf_policy import load_policy
from modules.policy.prompt_format import PlainText
from modules.policy.schedules import optimizers
from modules.policy.tiny_model import build_tiny_qwen


class SFTModule(L.LightningModule):
    needs_engine = False  # trains on reference responses: no engine, no rollout rules

    def __init__(
        self,
        model_path: str,
        optimizer: partial,
        scheduler: Callable | None = None,
        build: dict[str, Any] | None = None,
        max_new_tokens: int = 200,
    ) -> None:
        super().__init__()
        check("module.max_new_tokens", max_new_tokens, max_new_tokens >= 1, "an int >= 1")
        self.model_path = str(model_path)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.build = dict(build or {})
        self.max_new_tokens = max_new_tokens
        self.policy = None
        self.tokenizer = None

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        if not (Path(self.model_path) / "config.json").exists():
            if not self.build:  # model.build null: a pretrained model, not one built from a seed
                raise ConfigError(
                    f"invalid config value module.model_path={self.model_path!r}: must be a model "
                    f"directory (with config.json): build it with {build_command(self.model_path)}"
                )
            build_tiny_qwen(self.model_path, **self.build)
        self.policy, self.tokenizer = load_policy(self.model_path)
        self.policy.train()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.policy(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        )
        self.log("train/loss", out.loss, prog_bar=True)
        return out.loss

    @torch.no_grad()
    def validation_step(self, rows: list[dict], batch_idx: int) -> None:
        data = self.trainer.datamodule
        self.policy.eval()
        rewards = greedy_rewards(
            self.policy, self.tokenizer, data.task, rows, self.max_new_tokens, data.prompt_format
        )
        for r, row in zip(rewards, rows):
            self._val.append((row["level"], r))

    def on_validation_epoch_start(self) -> None:
        self._val: list[tuple[int, float]] = []

    def on_validation_epoch_end(self) -> None:
        self.policy.train()
        if not self._val:
            return
        rewards = torch.tensor([r for _, r in self._val])
        self.log("eval/reward_mean", rewards.mean(), prog_bar=True)
        for lv in sorted({lv for lv, _ in self._val}):
            lv_r = torch.tensor([r for level, r in self._val if level == lv])
            self.log(f"eval/reward_level{lv}", lv_r.mean())

    def configure_optimizers(self) -> Any:
        return optimizers(self.policy.parameters(), self.optimizer_factory, self.scheduler_factory)


def greedy_rewards(
    model: Any, tokenizer: Any, task: Any, rows: list[dict], max_new_tokens: int, prompt_format: Any = None
) -> list[float]:
    """Greedy-decode each prompt with transformers and score it with the task.

    Prompts are decoded in groups of equal length, unpadded: with left padding, positions
    would shift by the padding (``generate`` does not offset them here), and the model, trained
    on unpadded sequences, would be scored on inputs it never sees in the engine.
    """
    prompt_format = prompt_format if prompt_format is not None else PlainText()
    prompts = [prompt_format.ids(tokenizer, task.prompt_text(r)) for r in rows]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    texts: list[str] = [""] * len(rows)
    for idx in by_len.values():
        ids = torch.tensor([prompts[i] for i in idx], device=model.device)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        for i, t in zip(idx, tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)):
            texts[i] = t
    return [task.reward(r, t) for r, t in zip(rows, texts)]
