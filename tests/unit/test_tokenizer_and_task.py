from __future__ import annotations

import random

from data.tasks.remainder import LEVELS, RemainderTask, demonstrate, solve
from modules.policy.tiny_model import build_char_tokenizer


def test_tokenizer_round_trip():
    tok = build_char_tokenizer()
    for text in ["47%5=42,37,32.", "0", "368%9=359,350.", "a b"]:
        ids = tok(text)["input_ids"]
        assert len(ids) == len(text)  # one token per character
        assert tok.decode(ids) == text
    assert tok.decode([tok.eos_token_id], skip_special_tokens=True) == ""


def test_solve_reference():
    assert solve(9, 2) == "9-2=7;7-2=5;5-2=3;3-2=1."
    assert solve(5, 3) == "5-3=2."
    assert solve(9, 3) == "9-3=6;6-3=3;3-3=0."


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
        assert x <= 99 and task.min_divisor <= b <= task.max_divisor


def test_prefix_credit_counts_steps_before_the_first_mistake():
    task = RemainderTask()
    row = {"prompt": "9%2=", "answer": solve(9, 2)}
    assert task.reward(row, "9-2=7;7-2=5;5-2=3;3-2=1.") == 1.0
    assert task.reward(row, " 9-2=7;7-2=5;5-2=3;3-2=1.\n") == 1.0  # surrounding whitespace
    assert task.reward(row, "9-2=7;7-2=5;5-2=4;4-2=2.") == 0.5  # slip at step 3 of 4
    assert task.reward(row, "9-2=7;7-2=6;6-2=3;3-2=1.") == 0.25  # later steps do not count
    assert task.reward(row, "9-2=7;7-2=5;5-2=3;3-2=1") == 0.75  # no final "."
    assert task.reward(row, "9-2=7;7-2=5;5-2=3;3-2=1;1-2=0.") == 0.75  # kept going
    assert task.reward(row, "9-2=7;7-2=5;5-2=3;3-2=1.;1-2=0.") == 0.75  # did not stop after "."
    assert task.reward(row, "9-2=7;7-2=5;5-2=3;3-2=1.;") == 0.75
    assert task.reward(row, "9-2=7;7-2=5;5-2=3;3-2=1.x") == 0.75
    assert task.reward(row, "1.") == 0.0  # the right answer, no work shown
    assert task.reward(row, "") == 0.0


def test_exact_credit_accepts_only_the_exact_scratchpad():
    task = RemainderTask(credit="exact")
    row = {"prompt": "9%2=", "answer": solve(9, 2)}
    assert task.reward(row, "9-2=7;7-2=5;5-2=3;3-2=1.") == 1.0
    assert task.reward(row, "9-2=7;7-2=5;5-2=3;3-2=0.") == 0.0
    assert task.reward(row, "1.") == 0.0


def test_prefix_credit_is_one_exactly_when_exact_credit_is():
    rng = random.Random(0)
    prefix, exact = RemainderTask(), RemainderTask(credit="exact")
    for row in prefix.build("eval", 200).to_list():
        a, b = map(int, row["prompt"][:-1].split("%"))
        for response in (
            row["answer"],
            demonstrate(a, b, 0.3, rng),
            row["answer"][:-1],
            row["answer"] + "x",
            row["answer"] + ";",
            row["answer"] + ";" + row["answer"],
        ):
            assert (prefix.reward(row, response) == 1.0) == (exact.reward(row, response) == 1.0)
            assert 0.0 <= prefix.reward(row, response) <= 1.0


def test_demonstrator_slips_at_its_rate_and_propagates_its_slips():
    rng = random.Random(1)
    steps = slips = 0
    for _ in range(400):
        a, b = rng.randint(20, 99), rng.randint(2, 3)
        demo = demonstrate(a, b, 0.3, rng)
        assert demo.endswith(".")
        prev = a
        for step in demo[:-1].split(";"):
            lhs, w = step.split("=")
            v, bb = map(int, lhs.split("-"))
            assert v == prev and bb == b  # each step starts from the value written before
            assert int(w) >= 0 and int(w) in (v - b - 1, v - b, v - b + 1)
            steps += 1
            slips += int(w) != v - b
            prev = int(w)
        assert prev < b  # stops at the first value below b
    assert 0.25 < slips / steps < 0.32  # 0.3, less the slips that would go below 0
    assert demonstrate(50, 3, 0.0, rng) == solve(50, 3)


def test_sft_split_carries_the_demonstration_the_warm_start_imitates():
    from data.sft_data import target

    rows = RemainderTask().build("sft", 100).to_list()
    assert all(r["demo"].endswith(".") for r in rows)
    assert sum(r["demo"] != r["answer"] for r in rows) > 30  # sloppy, not a copy
    assert all(target(r) == r["demo"] for r in rows)
    assert target({"answer": "x"}) == "x"  # tasks without a demonstrator: the reference
    clean = RemainderTask(demo_slip=0.0).build("sft", 50).to_list()
    assert all(r["demo"] == r["answer"] for r in clean)


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
