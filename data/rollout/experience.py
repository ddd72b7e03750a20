"""The experience record: everything off-policy training needs to know about one response.

One ``Experience`` per sampled response. ``collate`` turns a list of them into the padded
tensors the loss consumes; tensors are aligned to *targets* (``input_ids[:, 1:]``), so
``behavior_logprobs[:, t]`` and ``loss_mask[:, t]`` describe token ``input_ids[:, t+1]``.
Later features add fields here (with defaults), never parallel dicts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class Experience:
    prompt_id: int  # row id in the task's train split
    group_id: int  # which GRPO group (one prompt, G responses) this belongs to
    sample_index: int  # position inside the group
    prompt_ids: list[int]
    response_ids: list[int]
    behavior_logprobs: list[float]  # mu: engine logprob of each response token at sampling time
    reward: float
    policy_version: int  # engine weight version when generation started
    sampling: dict[str, Any]  # temperature, top_p, top_k, max_tokens, seed
    gen_start: float  # wall-clock seconds (time.time())
    gen_end: float
    truncated: bool  # hit max_tokens (finish_reason == "length")
    finish_reason: str | None = None
    advantage: float = 0.0
    # (version, start, end) spans over response token indexes; one span in sync mode.
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # 1 for response tokens that are trained on. Default: all of them.
    loss_mask: list[int] | None = None
    difficulty: int | None = None  # task-defined bucket (e.g. level), for bias metrics
    weight: float = 1.0  # per-sample loss weight (staleness policies may change it)
    splits: int = 0  # times the request was aborted and resubmitted (carried over)
    staleness: int = 0  # trainer version at consumption minus the oldest token's version
    recompute: bool = False  # anchor the ratio at the trainer's current logprobs (Recompute)
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.behavior_logprobs) != len(self.response_ids):
            raise ValueError(
                f"behavior_logprobs has {len(self.behavior_logprobs)} entries for "
                f"{len(self.response_ids)} response tokens"
            )
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_ids)

    def token_versions(self) -> list[int]:
        """Policy version of every response token (from the spans)."""
        out = [self.policy_version] * len(self.response_ids)
        for version, start, end in self.version_spans:
            for i in range(start, min(end, len(out))):
                out[i] = version
        return out

    def oldest_version(self) -> int:
        """The oldest policy version that wrote one of its tokens (what staleness counts). An
        episode's observation tokens are in no span and no version wrote them: not counted."""
        return min((v for v, s, e in self.version_spans if e > s), default=self.policy_version)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def collate(batch: list[Experience], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors; ``[B, T]`` for tokens, ``[B, T-1]`` for per-target fields."""
    seqs = [e.prompt_ids + e.response_ids for e in batch]
    n = max(map(len, seqs))
    b = len(batch)
    input_ids = torch.full((b, n), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, n), dtype=torch.long)
    loss_mask = torch.zeros((b, n - 1), dtype=torch.float32)
    behavior = torch.zeros((b, n - 1), dtype=torch.float32)
    versions = torch.zeros((b, n - 1), dtype=torch.long)
    for i, (e, s) in enumerate(zip(batch, seqs)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = 1
        # Response token j sits at input position p+j, i.e. target index p+j-1.
        lo, hi = len(e.prompt_ids) - 1, len(s) - 1
        loss_mask[i, lo:hi] = torch.tensor(e.loss_mask, dtype=torch.float32)
        behavior[i, lo:hi] = torch.tensor(e.behavior_logprobs, dtype=torch.float32)
        versions[i, lo:hi] = torch.tensor(e.token_versions(), dtype=torch.long)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "behavior_logprobs": behavior,
        "token_versions": versions,
        "advantages": torch.tensor([e.advantage for e in batch], dtype=torch.float32),
        "rewards": torch.tensor([e.reward for e in batch], dtype=torch.float32),
        "weights": torch.tensor([e.weight for e in batch], dtype=torch.float32),
        "policy_versions": torch.tensor([e.policy_version for e in batch], dtype=torch.long),
        "group_ids": torch.tensor([e.group_id for e in batch], dtype=torch.long),
        "sample_indexes": torch.tensor([e.sample_index for e in batch], dtype=torch.long),
        "response_lengths": torch.tensor([len(e.response_ids) for e in batch], dtype=torch.long),
        "truncated": torch.tensor([e.truncated for e in batch], dtype=torch.bool),
        "recompute": torch.tensor([e.recompute for e in batch], dtype=torch.bool),
        "staleness": torch.tensor([e.staleness for e in batch], dtype=torch.long),
    }


def experience_line(e: Experience, step: int, version: int) -> dict[str, Any]:
    """One trained sample's record without its tokens (``experiences.jsonl``)."""
    return {
        "step": step,
        "version": version,
        "group": e.group_id,
        "sample": e.sample_index,
        "prompt_id": e.prompt_id,
        "level": e.difficulty,
        "prompt_len": len(e.prompt_ids),
        "len": len(e.response_ids),
        "gen_start": e.gen_start,
        "gen_end": e.gen_end,
        "reward": e.reward,
        "advantage": e.advantage,
        "staleness": e.staleness,
        "spans": e.version_spans,
        "splits": e.splits,
        "truncated": e.truncated,
        "weight": e.weight,
        **({"turns": e.extras["turns"]} if "turns" in e.extras else {}),
        # an episode's environment errors scored 0 under data.reward_errors=zero (docs/envs.md)
        **({"env_errors": len(e.extras["turns"][-1].get("env_errors", []))} if e.extras.get("turns") else {}),
    }
