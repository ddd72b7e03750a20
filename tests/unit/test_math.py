"""MATH recipe, offline: boxed extraction, answer equivalence, prompt format and reward on the
bundled examples, hub loading with a stand-in ``load_dataset``; the recipe composes and
validates. ``make install`` installs math-verify: the tests marked ``needs_math_verify`` run the
real library (and skip without it); every other test passes with and without it, and the
fallback (the normalised comparison alone) is tested with the import made to fail."""

from __future__ import annotations

import json
import pickle
import sys
import threading

import pytest

from data.tasks.math import (
    EXAMPLES,
    MathTask,
    answers_match,
    format_prompt,
    last_boxed,
    normalize_answer,
    parse_level,
)
from data.tasks.verify import math_verify_match
from modules.config.errors import ConfigError
from modules.launch.validate import validate
from tests.conftest import compose

try:
    import math_verify  # noqa: F401

    HAVE_MATH_VERIFY = True
except ImportError:
    HAVE_MATH_VERIFY = False

needs_math_verify = pytest.mark.skipif(
    not HAVE_MATH_VERIFY, reason="math-verify not installed (make install)"
)


@pytest.fixture
def no_math_verify(monkeypatch):
    """Make ``import math_verify`` fail, as on a machine without it."""
    monkeypatch.setitem(sys.modules, "math_verify", None)


def test_last_boxed_keeps_nested_braces():
    assert last_boxed(r"so $x = \boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\left( 3, \frac{\pi}{2} \right)}") == r"\left( 3, \frac{\pi}{2} \right)"
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"  # escaped braces are not groups
    assert last_boxed(r"\boxed{\sqrt{\frac{a}{b^{2}}}} and more text") == r"\sqrt{\frac{a}{b^{2}}}"


def test_last_boxed_last_one_wins():
    assert last_boxed(r"first \boxed{3}, then corrected: \boxed{4}") == "4"
    assert last_boxed(r"\boxed{\frac{1}{2}} ... \fbox{7}") == "7"
    assert last_boxed(r"\boxed{2} then \boxed 5") == "5"  # bare form, no braces
    assert last_boxed(r"\boxed{2} then \boxed{3") == "2"  # an unclosed box is ignored


def test_last_boxed_none():
    assert last_boxed("The answer is 42.") is None
    assert last_boxed(r"\boxed{oops") is None
    assert last_boxed("") is None


def test_parse_level():
    assert [parse_level(v) for v in ("Level 1", "Level 5", 3, "Level ?", None)] == [1, 5, 3, 0, 0]


EQUIVALENT = [
    (r"\frac{1}{2}", r"\dfrac12"),
    (r"\frac{1}{2}", "0.5"),
    (r"\frac{1}{2}", "1/2"),
    (r"\frac{1}{2}", r"\tfrac{1}{2}."),
    (r"-\frac{3}{4}", "-0.75"),
    ("120^\\circ", "120"),
    ("120^\\circ", "120^{\\circ}"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
    (r"\text{Thursday}", "Thursday"),
    ("10", r"10\text{ cm}"),
    ("1000", "1,000"),
    ("1000", "1{,}000"),
    ("5", "x = 5"),
    (r"\text{(C)}", "C"),
    ("50", r"50\%"),
    ("2\\sqrt{2}", "2\\sqrt2"),
    ("6", r"\!6\,"),
]

DIFFERENT = [
    (r"\frac{1}{2}", r"\frac{1}{3}"),
    (r"2\sqrt{2}", r"2\sqrt{3}"),
    ("36", "36.5"),
    ("(-2, 2)", "[-2, 2]"),
    (r"\text{Thursday}", "Friday"),
    ("6", "-6"),
    (r"\frac{1}{6}", "0.1667"),
    ("14", ""),
    (r"2\text{ and }3", "2"),
]


@pytest.mark.parametrize(("reference", "predicted"), EQUIVALENT)
def test_equivalent_forms_match(reference, predicted):
    assert answers_match(predicted, reference)


@pytest.mark.parametrize(("reference", "predicted"), EQUIVALENT)
def test_equivalent_forms_match_without_math_verify(reference, predicted, no_math_verify):
    assert answers_match(predicted, reference)


@pytest.mark.parametrize(("reference", "predicted"), DIFFERENT)
def test_different_answers_do_not_match(reference, predicted):
    assert not answers_match(predicted, reference)
    assert answers_match(None, reference) is False


def test_normalize_answer():
    assert normalize_answer(r" \left( 3, \dfrac{\pi}{2} \right) ") == r"(3,\frac{\pi}{2})"
    assert normalize_answer(r"$\frac12$") == r"\frac{1}{2}"
    assert normalize_answer(r"12\mbox{ inches}^2") == "12"


def test_symbolic_forms_need_math_verify():
    """Reordered lists and unsimplified radicals are math_verify's job; the fallback says no."""
    assert answers_match("3, 2", "2, 3") is HAVE_MATH_VERIFY
    assert answers_match(r"\sqrt{8}", r"2\sqrt{2}") is HAVE_MATH_VERIFY


def test_reward_off_the_main_thread():
    """Rewards run on the engine's callback thread, where math_verify may not set SIGALRM."""
    out: list[bool] = []
    thread = threading.Thread(target=lambda: out.append(answers_match("3, 2", "2, 3")))
    thread.start()
    thread.join()
    assert out == [HAVE_MATH_VERIFY]


def test_bundled_examples_are_complete():
    rows = [json.loads(line) for line in EXAMPLES.read_text().splitlines() if line.strip()]
    assert 8 <= len(rows) <= 12
    for r in rows:
        assert {"problem", "solution", "level", "type"} <= set(r)
        assert r["level"].startswith("Level ") and last_boxed(r["solution"])


def test_reward_on_bundled_examples():
    task = MathTask(offline=True)
    raw = [json.loads(line) for line in EXAMPLES.read_text().splitlines() if line.strip()]
    rows = task.build("train", 100)
    assert len(rows) == len(raw) and [r["id"] for r in rows] == list(range(len(rows)))
    assert all(1 <= r["level"] <= 5 and r["type"] for r in rows)
    for row, ex in zip(rows, raw):
        assert task.reward(row, ex["solution"]) == 1.0, row  # the worked solution scores 1
        assert task.reward(row, r"I think it is \boxed{999}.") == 0.0
        assert task.reward(row, "") == 0.0
    half = next(r for r in rows if r["answer"] == r"\frac{1}{2}")
    for response in (
        r"\boxed{\dfrac12}",
        r"so $\boxed{0.5}$",
        r"\boxed{1/2}",
        r"\boxed{3} no, \boxed{\frac{1}{2}}",
    ):
        assert task.reward(half, response) == 1.0, response
    assert task.reward(half, r"\boxed{\frac{1}{2}} no wait, \boxed{3}") == 0.0  # last box counts
    assert task.reward(half, "The answer is 1/2.") == 0.0  # no box, no reward


def _examples() -> list[tuple[dict, dict]]:
    raw = [json.loads(line) for line in EXAMPLES.read_text().splitlines() if line.strip()]
    return list(zip(MathTask(offline=True).build("train", 100), raw))


def _wrong(answer: str) -> str:
    """A wrong answer of the same shape: every digit moved by one, a word swapped."""
    out = "".join(str((int(c) + 1) % 10) if c.isdigit() else c for c in answer)
    return out.replace("Thursday", "Friday").replace(r"\pi", r"\pi^2")


NOT_MATH_VERIFY = {r"\tfrac{1}{2}.", r"50\%"}


@needs_math_verify
def test_math_verify_scores_the_bundled_examples(monkeypatch):
    """The library alone (normalised comparison off): every worked solution scores 1, a
    perturbed answer 0, and equivalent forms of 1/2 score 1."""
    task = MathTask(offline=True)
    monkeypatch.setattr("data.tasks.math.normalized_match", lambda p, r: False)
    rows = _examples()
    assert len(rows) >= 8
    for row, ex in rows:
        assert math_verify_match(last_boxed(ex["solution"]), row["answer"]) is True, row
        assert task.reward(row, ex["solution"]) == 1.0, row
        wrong = _wrong(row["answer"])
        assert wrong != row["answer"]
        assert math_verify_match(wrong, row["answer"]) is False, (row["answer"], wrong)
        assert task.reward(row, rf"so \boxed{{{wrong}}}") == 0.0, (row["answer"], wrong)
    half = next(row for row, _ in rows if row["answer"] == r"\frac{1}{2}")
    for form in (r"\dfrac12", "0.5", "1/2", r"\frac{2}{4}", "0.50", r"\frac12"):
        assert task.reward(half, rf"\boxed{{{form}}}") == 1.0, form


@needs_math_verify
@pytest.mark.parametrize(("reference", "predicted"), EQUIVALENT)
def test_math_verify_on_equivalent_forms(reference, predicted):
    assert math_verify_match(predicted, reference) is (predicted not in NOT_MATH_VERIFY)


@needs_math_verify
@pytest.mark.parametrize(("reference", "predicted"), DIFFERENT)
def test_math_verify_on_different_answers(reference, predicted):
    assert math_verify_match(predicted, reference) is False


def test_math_verify_match_is_none_without_the_library(no_math_verify):
    assert math_verify_match("1/2", r"\frac{1}{2}") is None
    assert answers_match("3, 2", "2, 3") is False  # the fallback: no symbolic comparison


@needs_math_verify
def test_math_verify_runs_on_any_thread():
    """Its SIGALRM timeouts are off (data/tasks/verify.py), so a reward scored on the engine's
    callback thread neither raises nor differs from the main thread's."""
    pairs = [("3, 2", "2, 3"), (r"\sqrt{8}", r"2\sqrt{2}"), ("5", "6")]
    out: list[list[bool]] = []
    thread = threading.Thread(target=lambda: out.append([answers_match(p, r) for p, r in pairs]))
    thread.start()
    thread.join()
    assert out == [[answers_match(p, r) for p, r in pairs]] == [[True, True, False]]


def test_task_pickles_for_reward_workers():
    """data.reward_timeout_s may score in a worker process holding a pickled copy of the task."""
    task = MathTask(offline=True)
    row = task.build("train", 1)[0]
    clone = pickle.loads(pickle.dumps(task))
    assert clone == task and clone.reward(row, r"\boxed{36}") == 1.0


def test_build_splits_sizes_and_levels():
    task = MathTask(offline=True)
    assert len(task.build("eval", 3)) == 3 and len(task.build("sft", 5)) == 5
    easy = MathTask(offline=True, levels=[1]).build("train", 100)
    assert easy and all(r["level"] == 1 for r in easy)
    with pytest.raises(ValueError, match="split"):
        task.build("test", 3)
    with pytest.raises(ConfigError, match="task.levels"):
        MathTask(levels=[6])
    with pytest.raises(ConfigError, match="task.train_dataset"):
        MathTask(train_dataset="")


def test_hub_rows_are_normalised(monkeypatch):
    """Subject configs are concatenated, a MATH-500-style ``answer`` column is preferred over
    the solution's box, and the sample is shuffled with the task seed (not grouped by subject)."""
    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        if path == "HuggingFaceH4/MATH-500":
            return [
                {"problem": "p", "solution": r"\boxed{2}", "answer": "3", "level": 4, "subject": "Algebra"}
            ]
        return [
            {
                "problem": f"{name} {i}",
                "solution": rf"so \boxed{{{i}}}",
                "level": f"Level {i % 5 + 1}",
                "type": name,
            }
            for i in range(10)
        ] + [{"problem": "unboxed", "solution": "no final answer", "level": "Level ?", "type": name}]

    monkeypatch.setattr("datasets.load_dataset", fake_load_dataset)
    task = MathTask(train_configs=["algebra", "geometry"])
    rows = task.build("train", 100)
    assert calls == [("EleutherAI/hendrycks_math", c, "train") for c in ("algebra", "geometry")]
    assert len(rows) == 20 and all(r["problem"] != "unboxed" for r in rows)
    assert [r["type"] for r in rows] != ["algebra"] * 10 + ["geometry"] * 10  # shuffled
    assert rows == MathTask(train_configs=["algebra", "geometry"]).build("train", 100)  # seeded
    assert {r["level"] for r in rows} == {1, 2, 3, 4, 5}

    math500 = MathTask(eval_dataset="HuggingFaceH4/MATH-500", eval_configs=None).build("eval", 10)
    assert calls[-1] == ("HuggingFaceH4/MATH-500", None, "test")
    assert math500 == [{"problem": "p", "answer": "3", "level": 4, "type": "Algebra", "id": 0}]


def test_prompt_is_the_problem_and_asks_for_a_box():
    """The task writes the user turn's text; the model's prompt_format renders it (the chat
    template path is tested with a real tokenizer in test_real_tokenizer.py)."""
    task = MathTask(offline=True)
    row = task.build("train", 1)[0]
    prompt = task.prompt_text(row)
    assert prompt == format_prompt(row["problem"])
    assert prompt.startswith(row["problem"]) and prompt.endswith(r"\boxed{}.")


def test_math_recipe_composes_and_validates():
    cfg = compose(["recipe=math_grpo"])
    validate(cfg)
    assert cfg.task._target_ == "data.tasks.math.MathTask"
    assert cfg.model.path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert cfg.data.prompt_format._target_.endswith("ChatTemplate")
    assert cfg.trainer.accelerator == "gpu"
    assert not set(cfg.engine.gpu_ids) & set(cfg.trainer.devices)
    assert cfg.rollout._target_.endswith("StreamingRollout")
    assert cfg.rollout.staleness._target_.endswith("Admit")
    assert cfg.rollout.sampling.max_tokens + 1024 <= cfg.engine.max_model_len
    assert list(cfg.task.eval_configs) == list(cfg.task.train_configs)
    # Constructing the task touches neither the hub nor a tokenizer.
    from hydra.utils import instantiate

    task = instantiate(cfg.task)
    assert isinstance(task, MathTask) and task.seed == 0 and len(task.train_configs) == 7
