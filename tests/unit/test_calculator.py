"""The calculator task (data/tasks/calculator.py): rows, demonstrations, reward, environment."""

from __future__ import annotations

import asyncio

import pytest

from data.envs.calculator_env import CalculatorEnv, calculate
from data.tasks.calculator import LEVELS, CalculatorTask
from modules.policy.tiny_model import ALPHABET


def test_rows_are_deterministic_and_inside_the_tokenizers_alphabet():
    task = CalculatorTask()
    a, b = task.build("sft", 200), task.build("sft", 200)
    assert a.to_list() == b.to_list()
    assert task.build("train", 50).to_list() != task.build("eval", 50).to_list()
    for row in a:
        assert set(row["prompt"] + "".join(row["demo"])) <= set(ALPHABET)
        x, y = map(int, row["prompt"][:-1].split("*"))
        assert (len(str(x)), len(str(y))) == LEVELS[row["level"]]
        assert row["answer"] == str(x * y)


def test_demonstrations_call_the_tool_at_the_configured_rate_and_guess_otherwise():
    task = CalculatorTask(demo_tool=0.3, demo_right=0.5)
    rows = task.build("sft", 3000).to_list()
    tool = [r for r in rows if len(r["demo"]) == 3]  # call, observation, answer
    assert 0.26 < len(tool) / len(rows) < 0.34
    assert all(r["demo"] == ["c=", f"{r['answer']};", "a."] for r in tool)
    direct = [r for r in rows if len(r["demo"]) == 1 and r["level"] > 0]
    assert all(r["demo"][0].startswith("a") for r in direct)
    right = sum(task.reward(r, r["demo"][0]) for r in direct) / len(direct)
    assert 0.45 < right < 0.55  # beyond one digit, answering in one's head is a coin flip
    assert all(task.reward(r, "".join(r["demo"])) == 1.0 for r in tool)


def test_the_environment_calls_the_calculator_and_scores_the_final_answer():
    env = CalculatorEnv(max_turns=3)
    row = {"id": 0, "prompt": "47*38?", "answer": "1786", "level": 2}

    async def episode(turns: list[str]):
        state = await env.reset(row)
        return [await env.step(state, t) for t in turns]

    call, answer = asyncio.run(episode(["c47*38=", "a1786."]))
    assert (
        call.observation == "1786;"
        and not call.done
        and call.info == {"valid_call": True, "tool_error": False}
    )
    assert answer.done and answer.reward == 1.0
    _, submitted = asyncio.run(episode(["c47*38=", "a."]))  # "a.": the result shown
    assert submitted.done and submitted.reward == 1.0
    question, done = asyncio.run(episode(["c=", "a."]))  # "c=": on the question
    assert question.observation == "1786;" and question.info["valid_call"] and done.reward == 1.0
    _, other = asyncio.run(episode(["c47*39=", "a."]))  # a valid call of the wrong product
    assert other.reward == 0.0
    for malformed in ("c47*=3=", "47*38=", "c47*38*2=", "="):
        (bad,) = asyncio.run(episode([malformed]))
        assert bad.observation == "error;" and bad.info["valid_call"] is False, malformed
    _, after_error = asyncio.run(episode(["c47*=", "a."]))  # nothing shown: no answer
    assert after_error.reward == 0.0
    for final in ("a1780.", "1786.", "a.", "a1786"):
        (wrong,) = asyncio.run(episode([final]))
        assert wrong.done and wrong.reward == 0.0, final
    assert env.stop == ("=",)
    task = CalculatorTask()  # the one-turn reward reads the same text the same way
    assert task.reward(row, "c47*38=1786;a.") == 1.0 and task.reward(row, "a1786.") == 1.0
    assert task.reward(row, "c47*38=error;a.") == 0.0 and task.reward(row, "a.") == 0.0
    # every episode text scores the same on both paths (the text path: an aborted episode, SFT)
    episodes = [
        ["c=", "a."],
        ["c=", "cX=", "a."],  # a malformed call after a good one: the display shows the error
        ["c=", "a1786."],
        ["5;a1786."],  # the model's own ";" is not an observation
        ["a1786."],
        ["c47*38=", "a."],
        ["c47*39=", "a."],
        ["c=", "c47*=", "a."],
    ]
    for turns in episodes:
        steps = asyncio.run(episode(turns))
        text = "".join(t + s.observation for t, s in zip(turns, steps))
        assert task.reward(row, text) == steps[-1].reward, (turns, text)
    with pytest.raises(ValueError, match="not a calculation"):
        calculate("4**2")


def test_the_recipes_compose_and_build_the_environment():
    from modules.launch.compose import build
    from tests.conftest import compose

    cfg = compose(["recipe=agent_calculator"])
    env = build(cfg.data.env)
    assert isinstance(env, CalculatorEnv) and env.max_turns == 3 and env.tools.retries == 1
    assert cfg.rollout.sampling.max_tokens == 32 and cfg.task._target_.endswith("CalculatorTask")
    assert compose([]).data.env is None  # one turn by default
    with pytest.raises(Exception, match="env.max_turns"):
        build(compose(["recipe=agent_calculator", "env.max_turns=0"]).data.env)


def test_a_critic_with_a_multi_turn_env_passes_start_up():
    """PPO's critic over episodes: GAE / V-trace run over the model tokens and skip the
    observations (modules/algo/gae.py, tests/unit/test_gae.py), so the combination is valid."""
    from modules.launch.validate import validate
    from tests.conftest import compose

    validate(compose(["recipe=ppo", "env=calculator", "task=calculator"]))


def test_the_warm_start_reads_the_observation_but_is_not_trained_to_predict_it():
    """SFT on a tool demonstration: the call and the answer are in the loss, the calculator's
    output is context only (as in RL), and the tokens are those an episode would hold."""
    from data.sft_data import SFTDataModule

    task = CalculatorTask(demo_tool=1.0)
    data = SFTDataModule(task, train_size=4, eval_size=1, batch_size=4)
    data.setup()
    rows = data.train_rows.to_list()
    batch = data._collate_train(rows)
    tok = data.tokenizer
    for i, row in enumerate(rows):
        n = int(batch["attention_mask"][i].sum())
        ids, labels = batch["input_ids"][i, :n].tolist(), batch["labels"][i, :n].tolist()
        call, observation, answer = row["demo"]
        assert tok.decode(ids) == row["prompt"] + call + observation + answer + tok.eos_token
        trained = tok.decode([t for t, lab in zip(ids, labels) if lab != -100])
        assert trained == call + answer + tok.eos_token
