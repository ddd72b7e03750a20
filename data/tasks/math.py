"""MATH task for GPU users: competition problems with LaTeX answers, reward by answer equivalence.

    python train.py recipe=math_grpo             # needs GPUs and the hub (model + dataset)

``build`` loads the data with ``datasets.load_dataset`` at run time (network on first use; the
tests use the bundled ``math_examples.jsonl``). Default: ``EleutherAI/hendrycks_math`` (MIT,
the 12,500 problems of Hendrycks et al. 2021 as seven subject configs with ``problem``,
``level`` ("Level 1".."Level 5"), ``type`` and ``solution`` columns), its ``train`` split for
training and a seeded sample of its ``test`` split for evaluation. ``HuggingFaceH4/MATH-500``
(500 of those test problems, with ``answer``, ``subject`` and integer ``level`` columns) also
loads: ``task.eval_dataset=HuggingFaceH4/MATH-500 task.eval_configs=null``.

Rows carry ``level`` 1..5 (0 where the dataset says "Level ?"), the key of the difficulty
metrics (``bias/trained_frac_level<k>``, ``eval/sampled_reward_level<k>``, stratified batches).

Reward: 1.0 when the last ``\\boxed{...}`` of the response is equivalent to the reference (the
dataset's ``answer`` column, else the last ``\\boxed{...}`` of its solution), else 0.0; a
response without a box earns nothing. Equivalence is a cheap normalised comparison first
(``normalize_answer``: spacing, ``\\left``/``\\right``, ``\\dfrac``, degrees, ``\\text{}`` units,
exact fractions/decimals), then math-verify (symbolic, sets, intervals, ...; installed by
``make install``, see ``data/tasks/verify.py``). Without math-verify only the normalised
comparison runs.

The prompt asks for the final answer in ``\\boxed{}``. It is the problem and the request only:
the model's ``model.prompt_format`` makes it a chat template's user turn (``math_grpo`` sets
``ChatTemplate``, ``modules/policy/prompt_format.py``) or leaves it as the text. A base model
under ``PlainText`` no longer gets the old ``Problem: ... Solution:`` completion cue.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from data.tasks.verify import math_verify_match
from modules.config.errors import check

EXAMPLES = Path(__file__).with_name("math_examples.jsonl")
SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
INSTRUCTION = "Work through the problem step by step, then write only the final answer inside \\boxed{}."

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOX_BARE = re.compile(r"\\boxed[ \t]+([^\s$]+)")  # "\boxed 5": no braces


# ---------------------------------------------------------------------- extraction
def _balanced(text: str, open_at: int) -> str | None:
    """Content of the brace group whose ``{`` is at ``open_at``; None if it never closes."""
    depth = 0
    for i in range(open_at, len(text)):
        c = text[i]
        escaped = i > 0 and text[i - 1] == "\\"  # \{ and \} are literal braces, not a group
        if c == "{" and not escaped:
            depth += 1
        elif c == "}" and not escaped:
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces
    kept whole (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``); None if there is none."""
    found: tuple[int, str] | None = None
    for m in _BOX_START.finditer(text):
        inner = _balanced(text, m.end() - 1)
        if inner is not None:
            found = (m.start(), inner)
    for m in _BOX_BARE.finditer(text):
        if found is None or m.start() > found[0]:
            found = (m.start(), m.group(1))
    return None if found is None else found[1].strip()


def parse_level(value: Any) -> int:
    """``"Level 3"`` or ``3`` -> 3; anything unrated (``"Level ?"``, missing) -> 0."""
    if isinstance(value, int):
        return value
    m = re.search(r"\d+", str(value or ""))
    return int(m.group()) if m else 0


# ---------------------------------------------------------------------- equivalence
def _strip_text_wrappers(s: str) -> str:
    # Units after a value ("5\text{ cm}", "12\mbox{ inches}^2") go; a text-only answer
    # ("\text{Tuesday}", "\text{(C)}") keeps its words, and so does "2\text{ and }3".
    unit = re.fullmatch(r"(.*?\d.*?)\s*\\(?:text|mbox|mathrm)\{(?!\s*(?:and|or)\b)[^{}]*\}(?:\^\{?\d\}?)?", s)
    if unit:
        s = unit.group(1)
    return re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}", r"\1", s)


def normalize_answer(answer: str) -> str:
    """A canonical string for a final answer, for the comparison without ``math_verify``."""
    s = answer.strip()
    for delims in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(delims[0]) and s.endswith(delims[1]) and len(s) > 1:
            s = s[len(delims[0]) : len(s) - len(delims[1])]
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\(?:left|right|displaystyle)(?![A-Za-z])", "", s)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    s = re.sub(r"\\[!,;:]|\\ |\\q?quad(?![A-Za-z])|~", "", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°", "", s)  # degrees
    s = s.replace("\\%", "").replace("%", "")
    s = _strip_text_wrappers(s.strip())
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = s.replace("{,}", "")  # 1{,}000
    # \frac12 -> \frac{1}{2}, \frac1{b} / \frac{a}2 likewise; \sqrt2 -> \sqrt{2}
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d+|[A-Za-z])(?![A-Za-z])", r"\\sqrt{\1}", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators
        s = s.replace(",", "")
    if re.fullmatch(r"[A-Za-z]=[^=]+", s):  # "x=5" -> "5"
        s = s[2:]
    m = re.fullmatch(r"\(([A-Ea-e])\)", s)  # "(C)" -> "C"
    return m.group(1) if m else s


def _as_number(s: str) -> Fraction | None:
    """An exact value for an integer, decimal, ``a/b`` or ``\\frac{a}{b}`` (signs allowed)."""
    try:
        if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
            return Fraction(s)
        m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s) or re.fullmatch(r"(-?)(\d+)/(\d+)", s)
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
    except (ValueError, ZeroDivisionError):
        return None
    return None


def normalized_match(predicted: str, reference: str) -> bool:
    a, b = normalize_answer(predicted), normalize_answer(reference)
    if a == b and a != "":
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and x == y


def answers_match(predicted: str | None, reference: str) -> bool:
    """The normalised comparison, then math-verify when it is installed."""
    if predicted is None or not predicted.strip():
        return False
    if normalized_match(predicted, reference):
        return True
    return bool(math_verify_match(predicted, reference))  # None (not installed) -> no match


# ---------------------------------------------------------------------- prompt
def format_prompt(problem: str) -> str:
    """The problem and the request for a boxed answer (the user turn of a chat model)."""
    return f"{problem}\n\n{INSTRUCTION}"


# ---------------------------------------------------------------------- task
@dataclass
class MathTask:
    name: str = "math"
    train_dataset: str = "EleutherAI/hendrycks_math"
    train_configs: tuple[str, ...] | None = SUBJECTS  # dataset configs concatenated; None = default
    train_split: str = "train"
    eval_dataset: str = "EleutherAI/hendrycks_math"
    eval_configs: tuple[str, ...] | None = SUBJECTS
    eval_split: str = "test"
    levels: tuple[int, ...] | None = None  # keep only these difficulty levels (1..5); None = all
    seed: int = 0  # order of the rows before the first `size` are taken
    offline: bool = False  # use the bundled examples instead of the hub
    hub_datasets = ("train_dataset", "eval_dataset")  # checked on this machine at start-up

    def __post_init__(self) -> None:
        for field in ("train_dataset", "eval_dataset"):
            check(
                f"task.{field}", getattr(self, field), bool(getattr(self, field)), "a dataset name on the hub"
            )
        self.train_configs = None if self.train_configs is None else tuple(self.train_configs)
        self.eval_configs = None if self.eval_configs is None else tuple(self.eval_configs)
        if self.levels is not None:
            self.levels = tuple(int(lv) for lv in self.levels)
            check(
                "task.levels",
                list(self.levels),
                len(self.levels) > 0 and all(0 <= lv <= 5 for lv in self.levels),
                "null or a non-empty list of levels in 0..5 (0 = unrated)",
            )

    def _load(self, dataset: str, configs: tuple[str, ...] | None, split: str) -> list[dict]:
        from datasets import load_dataset

        if not configs:
            return list(load_dataset(dataset, split=split))
        return [r for c in configs for r in load_dataset(dataset, c, split=split)]

    def build(self, split: str, size: int, level_weights: object = None) -> list[dict]:
        if split not in ("train", "eval", "sft"):  # a caller's mistake, not a config value
            raise ValueError(f"split={split!r}: must be one of train, eval, sft")
        if self.offline:
            raw = [json.loads(line) for line in EXAMPLES.read_text().splitlines() if line.strip()]
        elif split == "eval":
            raw = self._load(self.eval_dataset, self.eval_configs, self.eval_split)
        else:
            raw = self._load(self.train_dataset, self.train_configs, self.train_split)
        rows = []
        for r in raw:
            answer = r.get("answer") or last_boxed(r.get("solution", ""))
            level = parse_level(r.get("level"))
            if not answer or (self.levels is not None and level not in self.levels):
                continue  # no gradable reference, or a level left out
            rows.append(
                {
                    "problem": r["problem"],
                    "answer": answer,
                    "level": level,
                    "type": r.get("type") or r.get("subject") or "",
                }
            )
        if not self.offline:  # hub splits come grouped by subject: sample across all of them
            random.Random(self.seed).shuffle(rows)
        rows = rows[:size]
        for i, row in enumerate(rows):
            row["id"] = i
        return rows

    def prompt_text(self, row: dict) -> str:
        return format_prompt(row["problem"])

    def reward(self, row: dict, response: str) -> float:
        return 1.0 if answers_match(last_boxed(response), row["answer"]) else 0.0
