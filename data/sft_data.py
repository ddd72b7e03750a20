"""Supervised warm start data: task prompts with their reference responses.

The RL recipes start from a model that already solves some prompts (GRPO learns nothing from
groups whose rewards are all equal), so ``recipe=sft_warmup`` first trains the tiny random
model on reference scratchpads. It is deliberately stopped early: accuracy lands in the
middle, falling with difficulty, which leaves room for RL.

The model's tokenizer: the character tokenizer of the tiny model (``tokenizer_path`` null: the
model is built from a seed, ``model.build``), or a pretrained model's own (``tokenizer_path``:
its directory; ``recipe=smollm2_sft_tools``). A demonstration is tokenised exactly as an
episode is built (``data/envs/episodes.py``): the prompt by ``model.prompt_format``, each model
turn alone, each observation as the prompt format renders it (a chat model: the template's
tool turn) alone, then EOS; the loss is on the model's tokens and the final EOS only.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler

from modules.config.errors import ConfigError, check
from modules.config.resources import build_command
from modules.policy.prompt_format import PlainText
from modules.policy.tiny_model import build_char_tokenizer


def segments(row: dict) -> list[tuple[str, bool]]:
    """What SFT imitates, as (text, trained) pieces: the row's ``demo`` where the task provides
    one (the remainder task's sloppy demonstrator), else its reference ``answer``. A multi-turn
    demonstration is a list of turns, the model's and the environment's alternating
    (the calculator's ``["c=", "1786;", "a."]``): the observations are in the context, not in
    the loss, as in RL (data/envs/episodes.py), so the warm start is not trained to predict
    the tool's output."""
    demo = row.get("demo")
    if demo is None:
        return [(row["answer"], True)]
    if isinstance(demo, str):
        return [(demo, True)]
    return [(text, i % 2 == 0) for i, text in enumerate(demo)]


def target(row: dict) -> str:
    """The whole demonstrated response as text (observations included)."""
    return "".join(text for text, _ in segments(row))


def demonstration_ids(
    tokenizer: Any, prompt_format: Any, prompt: str, pieces: list[tuple[str, bool]]
) -> tuple[list[int], list[int]]:
    """A demonstration's ids and labels (-100 off the loss), built as an episode is: the prompt
    by ``prompt_format.ids``, then each piece tokenised alone without special tokens, a model
    turn trained, an observation rendered by ``prompt_format.observation`` and not trained."""
    ids = list(prompt_format.ids(tokenizer, prompt))
    labels = [-100] * len(ids)
    for text, trained in pieces:
        text = text if trained else prompt_format.observation(tokenizer, text)
        piece = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids += piece
        labels += piece if trained else [-100] * len(piece)
    return ids, labels


class LengthBucketSampler(Sampler[list[int]]):
    """Batches of similar length (padding waste is ~6x without it: the length tail is long).

    Shuffles, sorts within windows of 50 batches, then shuffles the batches; a new order
    each epoch, deterministic from ``seed``.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int = 0) -> None:
        self.lengths = lengths
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0

    def __iter__(self) -> Iterator[list[int]]:
        rng = random.Random(self.seed + self.epoch)
        self.epoch += 1
        idx = list(range(len(self.lengths)))
        rng.shuffle(idx)
        window = self.batch_size * 50
        batches = []
        for w in range(0, len(idx), window):
            chunk = sorted(idx[w : w + window], key=self.lengths.__getitem__)
            batches += [chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
        rng.shuffle(batches)
        return iter(batches)

    def __len__(self) -> int:
        return (len(self.lengths) + self.batch_size - 1) // self.batch_size


class SFTDataModule(L.LightningDataModule):
    def __init__(
        self,
        task: Any,
        train_size: int = 20000,
        eval_size: int = 256,
        batch_size: int = 64,
        eval_batch_size: int = 128,
        num_workers: int = 0,
        level_weights: list[float] | None = None,
        prompt_format: Any = None,
        tokenizer_path: str | None = None,
    ) -> None:
        super().__init__()
        check("data.train_size", train_size, train_size >= 1, "an int >= 1")
        check("data.batch_size", batch_size, batch_size >= 1, "an int >= 1")
        check("data.eval_size", eval_size, eval_size >= 1, "an int >= 1")
        self.task = task
        self.train_size = train_size
        self.eval_size = eval_size
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.level_weights = None if level_weights is None else tuple(level_weights)
        # model.prompt_format (modules/policy/prompt_format.py): a task's text -> the prompt's ids
        self.prompt_format = prompt_format if prompt_format is not None else PlainText()
        self.tokenizer_path = tokenizer_path
        self.tokenizer: Any = build_char_tokenizer() if tokenizer_path is None else None

    def preflight(self, max_model_len: int | None) -> None:
        """Start-up checks before a model is built (``modules/launch/start.py``): a pretrained
        model's directory holds a model, and its tokenizer renders the prompt format."""
        if self.tokenizer_path is None:  # the character tokenizer: it renders plain text only
            self.prompt_format.check(self.tokenizer, "the character tokenizer (data.tokenizer_path=null)")
            return
        if not Path(self.tokenizer_path, "config.json").is_file():
            raise ConfigError(
                f"invalid config value data.tokenizer_path={self.tokenizer_path!r}: must be a model "
                f"directory (with config.json): build it with {build_command(self.tokenizer_path)}"
            )
        self._load_tokenizer()
        self.prompt_format.check(self.tokenizer, self.tokenizer_path)

    def _load_tokenizer(self) -> None:
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)

    def setup(self, stage: str | None = None) -> None:
        self._load_tokenizer()
        self.train_rows = self.task.build("sft", self.train_size, self.level_weights)
        self.eval_rows = self.task.build("eval", self.eval_size)

    def _collate_train(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        tok, eos, pad = self.tokenizer, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        seqs, labels = [], []
        for r in rows:
            ids, lab = demonstration_ids(tok, self.prompt_format, self.task.prompt_text(r), segments(r))
            seqs.append(ids + [eos])
            labels.append(lab + [eos])
        n = max(map(len, seqs))
        ids = torch.full((len(seqs), n), pad)
        lab = torch.full((len(seqs), n), -100)
        mask = torch.zeros((len(seqs), n), dtype=torch.long)
        for i, (s, lb) in enumerate(zip(seqs, labels)):
            ids[i, : len(s)] = torch.tensor(s)
            lab[i, : len(lb)] = torch.tensor(lb)
            mask[i, : len(s)] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": lab}

    def train_dataloader(self) -> DataLoader:
        rows = list(self.train_rows)
        lengths = [len(r.get("prompt") or self.task.prompt_text(r)) + len(target(r)) for r in rows]
        sampler = LengthBucketSampler(lengths, self.batch_size)
        return DataLoader(
            rows, batch_sampler=sampler, collate_fn=self._collate_train, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            list(self.eval_rows), batch_size=self.eval_batch_size, shuffle=False, collate_fn=lambda rows: rows
        )
