"""GSM8K recipe, offline: prompt format and reward on the bundled examples (with the real
math-verify, and with its fallback); the reward on another thread and in a reward worker; the
recipe composes."""

from __future__ import annotations

import json
import sys

import pytest

from data.tasks.gsm8k import EXAMPLES, GSM8KTask, extract_answer, reference_answer
from data.tasks.verify import math_verify_match
from tests.conftest import compose

try:
    import math_verify  # noqa: F401

    HAVE_MATH_VERIFY = True
except ImportError:
    HAVE_MATH_VERIFY = False

needs_math_verify = pytest.mark.skipif(
    not HAVE_MATH_VERIFY, reason="math-verify not installed (make install)"
)


def test_reference_and_extraction():
    assert reference_answer("... so 12 pages\n#### 1,624") == "1624"
    assert extract_answer("so the total is 72.\n#### 72") == "72"
    assert extract_answer("The answer is \\boxed{10}.") == "10"
    assert extract_answer("48 + 24 = 72 clips") == "72"
    assert extract_answer("no digits here") is None


def test_prompt_and_reward_on_bundled_examples():
    task = GSM8KTask(offline=True)
    rows = task.build("train", 10)
    assert len(rows) == 4 and rows[0]["answer"] == "72"
    prompt = task.prompt_text(rows[0])
    assert prompt.startswith("Question: Natalia") and prompt.endswith("Answer:")
    assert task.reward(rows[0], "She sold 24 in May, so 48+24=72.\n#### 72") == 1.0
    assert task.reward(rows[0], "#### 71") == 0.0
    assert task.reward(rows[1], "She earned \\boxed{10}") == 1.0
    assert task.reward(rows[3], "") == 0.0


def test_gsm8k_recipe_composes_for_gpu():
    cfg = compose(["recipe=gsm8k_grpo"])
    assert cfg.engine.gpu_ids == [1] and cfg.trainer.accelerator == "gpu"  # trainer on GPU 0
    assert cfg.task._target_ == "data.tasks.gsm8k.GSM8KTask"


def _wrong(answer: str) -> str:
    return str(int(answer) + 1)


@needs_math_verify
def test_math_verify_scores_the_bundled_examples():
    """The real library: each worked solution scores 1, a perturbed answer 0, and other
    forms of the same number (decimal zeros, a box, thousands separators) 1."""
    task = GSM8KTask(offline=True)
    raw = [json.loads(line) for line in EXAMPLES.read_text().splitlines() if line.strip()]
    for row, ex in zip(task.build("train", 10), raw):
        assert math_verify_match(extract_answer(ex["answer"]), row["answer"]) is True
        assert task.reward(row, ex["answer"]) == 1.0, row
        wrong = _wrong(row["answer"])
        assert math_verify_match(wrong, row["answer"]) is False
        assert task.reward(row, f"so it is {wrong}.\n#### {wrong}") == 0.0
        for form in (f"#### {row['answer']}.00", f"\\boxed{{{row['answer']}.0}}"):
            assert task.reward(row, form) == 1.0, form
    natalia = task.build("train", 1)[0]
    assert task.reward(natalia, "#### 72.5") == 0.0


def test_fallback_without_math_verify(monkeypatch):
    """Users who remove math-verify keep a working reward: an exact numeric comparison."""
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now fails
    task = GSM8KTask(offline=True)
    rows = task.build("train", 10)
    assert math_verify_match("72", "72") is None
    for row in rows:
        assert task.reward(row, f"#### {row['answer']}") == 1.0
        assert task.reward(row, f"#### {row['answer']}.0") == 1.0
        assert task.reward(row, f"#### {_wrong(row['answer'])}") == 0.0
    assert task.reward(rows[3], "#### 1,624") == 0.0 and task.reward(rows[3], "#### 624") == 1.0
