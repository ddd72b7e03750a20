"""GSM8K recipe, offline: prompt format and reward on the bundled examples; the recipe composes."""

from __future__ import annotations

from data.tasks.gsm8k import GSM8KTask, extract_answer, reference_answer
from tests.conftest import compose


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
