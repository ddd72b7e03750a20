from __future__ import annotations

from data.tasks.remainder import LEVELS, RemainderTask, solve
from modules.tiny_model import build_char_tokenizer


def test_tokenizer_round_trip():
    tok = build_char_tokenizer()
    for text in ["47%5=42,37,32.", "0", "368%9=359,350.", "a b"]:
        ids = tok(text)["input_ids"]
        assert len(ids) == len(text)  # one token per character
        assert tok.decode(ids) == text
    assert tok.decode([tok.eos_token_id], skip_special_tokens=True) == ""


def test_solve_reference():
    assert solve(47, 5) == "42,37,32,27,22,17,12,7,2."
    assert solve(5, 3) == "2."
    assert solve(9, 3) == "6,3,0."


def test_generator_is_deterministic_and_splits_differ():
    task = RemainderTask(seed=3)
    a = task.build("train", 50).to_list()
    assert a == task.build("train", 50).to_list()
    assert a != task.build("eval", 50).to_list()
    for row in a:
        x, b = map(int, row["prompt"][:-1].split("%"))
        assert row["answer"] == solve(x, b)
        lo, hi = LEVELS[row["level"]]
        assert lo <= row["steps"] <= hi and x // b == row["steps"]


def test_verifier_accepts_only_the_exact_scratchpad():
    task = RemainderTask()
    row = {"prompt": "47%5=", "answer": solve(47, 5)}
    assert task.reward(row, "42,37,32,27,22,17,12,7,2.") == 1.0
    assert task.reward(row, "2.") == 0.0  # right answer, no work shown
    assert task.reward(row, "42,37,32,27,22,17,12,7,3.") == 0.0
    assert task.reward(row, "") == 0.0


def test_lengths_are_long_tailed_and_track_difficulty():
    rows = RemainderTask().build("train", 3000).to_list()
    mean_len = {lv: 0.0 for lv in range(len(LEVELS))}
    for lv in mean_len:
        lens = [len(r["answer"]) for r in rows if r["level"] == lv]
        mean_len[lv] = sum(lens) / len(lens)
    assert mean_len[0] < mean_len[1] < mean_len[2]
    assert mean_len[2] / mean_len[0] >= 10
    # long tail: most prompts are short
    assert sum(r["level"] == 0 for r in rows) > sum(r["level"] == 2 for r in rows) * 3
