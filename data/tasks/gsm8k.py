"""GSM8K task for GPU users: grade-school math word problems, reward by answer verification.

    python train.py recipe=gsm8k_grpo            # needs a GPU and the hub (model + dataset)

``build`` loads ``openai/gsm8k`` with ``datasets.load_dataset`` (network on first use; the
tests use the bundled ``gsm8k_examples.jsonl``). The reward is 1.0 when the response's final
answer (``#### 42``, ``\\boxed{42}`` or a trailing number) equals the reference, by math-verify
(``data/tasks/verify.py``; ``make install`` installs it), or, where it is not installed, by an
exact numeric comparison.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from data.tasks.verify import math_verify_match
from modules.config.errors import check

EXAMPLES = Path(__file__).with_name("gsm8k_examples.jsonl")
PROMPT = "Question: {question}\nSolve it step by step and end with '#### <answer>'.\nAnswer:"
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


def reference_answer(solution: str) -> str:
    """GSM8K solutions end with '#### <number>'."""
    return solution.split("####")[-1].strip().replace(",", "")


def extract_answer(response: str) -> str | None:
    for pattern in (rf"####\s*({_NUMBER})", rf"\\boxed\{{\s*({_NUMBER})\s*\}}"):
        found = re.findall(pattern, response)
        if found:
            return found[-1].replace(",", "")
    numbers = re.findall(_NUMBER, response)
    return numbers[-1].replace(",", "") if numbers else None


def answers_match(predicted: str | None, reference: str) -> bool:
    if predicted is None:
        return False
    verified = math_verify_match(predicted, reference)
    if verified is not None:
        return verified
    try:  # fallback without math-verify
        return abs(float(predicted) - float(reference)) < 1e-6
    except ValueError:
        return False


@dataclass
class GSM8KTask:
    name: str = "gsm8k"
    dataset: str = "openai/gsm8k"
    offline: bool = False  # use the bundled examples instead of the hub
    # fields naming hub datasets: the start-up check asks this machine for them (preflight.py)
    hub_datasets = ("dataset",)

    def __post_init__(self) -> None:
        check("task.dataset", self.dataset, bool(self.dataset), "a dataset name on the hub")

    def build(self, split: str, size: int, level_weights: object = None) -> list[dict]:
        if split not in ("train", "eval", "sft"):  # a caller's mistake, not a config value
            raise ValueError(f"split={split!r}: must be one of train, eval, sft")
        if self.offline:
            rows = [json.loads(line) for line in EXAMPLES.read_text().splitlines() if line.strip()]
        else:
            from datasets import load_dataset

            hf_split = "test" if split == "eval" else "train"
            rows = list(load_dataset(self.dataset, "main", split=hf_split))
        out = []
        for i, r in enumerate(rows[:size]):
            out.append(
                {
                    "id": i,
                    "question": r["question"],
                    "answer": reference_answer(r["answer"]),
                    "level": min(2, r["answer"].count("<<") // 2),
                }
            )  # number of calculator steps
        return out

    def prompt_text(self, row: dict) -> str:
        return PROMPT.format(question=row["question"])

    def reward(self, row: dict, response: str) -> float:
        return 1.0 if answers_match(extract_answer(response), row["answer"]) else 0.0
