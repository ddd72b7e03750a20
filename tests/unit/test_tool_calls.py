"""Tool calls in the chat model's format (``data/envs/tool_calls.py``), the chat calculator
environment (``data/envs/chat_tools.py``), its task (``data/tasks/tool_arithmetic.py``) and stop
strings of several tokens (``data/envs/stops.py``) on the character tokenizer. Milliseconds."""

from __future__ import annotations

import asyncio

import pytest

from data.envs.chat_tools import ChatCalculatorEnv, calculate
from data.envs.stops import Stops
from data.envs.tool_calls import Malformed, ToolCall, format_tool_call, parse_tool_call
from data.envs.tools import ToolRunner
from data.tasks.tool_arithmetic import ToolArithmeticTask, answer_text, call_text
from modules.config.errors import ConfigError
from modules.engine.sim import CharTokenizer
from modules.engine.types import SamplingConfig
from modules.policy.tiny_model import build_char_tokenizer

TOOLS = {"calculator": ("expression",)}
GOOD = '<tool_call>{"name": "calculator", "arguments": {"expression": "23*47"}}</tool_call>'


def test_a_well_formed_call_is_parsed_and_a_turn_without_one_is_an_answer():
    assert parse_tool_call(GOOD, TOOLS) == ToolCall("calculator", {"expression": "23*47"})
    assert parse_tool_call("Let me compute. " + GOOD + ".", TOOLS) == ToolCall(
        "calculator", {"expression": "23*47"}
    )
    assert parse_tool_call("The answer is 1081.", TOOLS) is None
    assert parse_tool_call(format_tool_call("calculator", {"expression": "2*3"}), TOOLS).arguments == {
        "expression": "2*3"
    }
    assert call_text("2*3") == format_tool_call("calculator", {"expression": "2*3"})


@pytest.mark.parametrize(
    "turn, reason",
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "23*47"}', "no closing </tool_call>"),
        ('{"name": "calculator"}</tool_call>', "without <tool_call>"),
        ("<tool_call>calculator(23*47)</tool_call>", "not JSON"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "23*47"}</tool_call>', "not JSON"),
        ('<tool_call>["calculator"]</tool_call>', "JSON object"),
        ('<tool_call>{"arguments": {"expression": "1+1"}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', "unknown tool 'search'"),
        ('<tool_call>{"name": "calculator", "arguments": "23*47"}</tool_call>', '"arguments" must be'),
        ('<tool_call>{"name": "calculator", "arguments": {"expr": "23*47"}}</tool_call>', "'expression'"),
        ('<tool_call>{"name": "calculator"}</tool_call>', "'expression'"),
    ],
)
def test_a_malformed_call_is_a_reason_never_an_exception(turn, reason):
    out = parse_tool_call(turn, TOOLS)
    assert isinstance(out, Malformed) and reason in out.reason, out


def test_the_calculator_takes_arithmetic_only():
    assert calculate("23*47") == 1081 and calculate("(19*61)+63") == 1222 and calculate("12 x 3") == 36
    assert calculate("5-7") == -2
    for bad in ("__import__('os')", "9**99", "1/2", "10000000*2", "2*" * 40 + "2", 42, "23*"):
        with pytest.raises(ValueError):
            calculate(bad)


def run_step(env: ChatCalculatorEnv, turn: str, row: dict):
    return asyncio.run(env.step({"row": row}, turn))


def test_the_environment_answers_calls_counts_malformed_ones_and_scores_the_answer():
    env = ChatCalculatorEnv(tools=ToolRunner(concurrency=2, timeout_s=5.0))
    row = {"id": 0, "level": 1, "answer": "1081"}
    step = run_step(env, GOOD, row)
    assert (step.observation, step.done, step.info) == (
        "1081",
        False,
        {"valid_call": True, "tool_error": False},
    )
    step = run_step(env, "<tool_call>{'name': 'calculator'}</tool_call>", row)
    assert step.observation.startswith("Error: the call is not JSON") and not step.done
    assert step.info == {"valid_call": False, "tool_error": False}
    step = run_step(
        env, '<tool_call>{"name": "calculator", "arguments": {"expression": "23/0"}}</tool_call>', row
    )
    assert step.info == {"valid_call": True, "tool_error": True} and "ValueError" in step.observation
    assert (
        run_step(env, answer_text(1081), row).reward == 1.0
        and run_step(env, "The answer is 1080.", row).reward == 0.0
    )
    assert run_step(env, "It is 1,081", row).done
    env.close()


@pytest.mark.parametrize("demo_valid", [1.0, 0.25])
def test_task_rows_levels_demonstrations_and_reward(demo_valid):
    task = ToolArithmeticTask(demo_valid=demo_valid)
    rows = task.build("sft", 600)
    assert {r["level"] for r in rows} == {0, 1, 2}
    assert task.build("eval", 5) == task.build("eval", 5) and task.build("eval", 5) != task.build("train", 5)
    env = ChatCalculatorEnv(tools=ToolRunner(concurrency=2, timeout_s=5.0))
    malformed = []
    for r in rows:
        assert calculate(r["expression"]) == int(r["answer"])
        demo = r["demo"]
        assert len(demo) in (1, 3) and demo[-1].startswith("The answer is")
        if len(demo) == 3:  # a call, the tool's output, the answer
            # the demonstrated observation is what the environment answers to that call
            assert run_step(env, demo[0], r).observation == demo[1]
            call = parse_tool_call(demo[0], TOOLS)
            if isinstance(call, Malformed):
                malformed.append(call.reason)
                continue
            assert call == ToolCall("calculator", {"expression": r["expression"]})
            assert demo[1] == r["answer"] and task.reward(r, demo[2]) == 1.0
    env.close()
    tool_share = sum(len(r["demo"]) == 3 for r in rows) / len(rows)
    assert 0.4 < tool_share < 0.6
    calls = sum(len(r["demo"]) == 3 for r in rows)
    assert abs(len(malformed) / calls - (1 - demo_valid)) < 0.08
    assert len(set(malformed)) == (3 if demo_valid < 1 else 0)  # every kind of slip occurs
    assert "<tool_call>" in task.prompt_text(rows[0]) and rows[0]["question"] in task.prompt_text(rows[0])
    with pytest.raises(ConfigError, match="task.demo_tool"):
        ToolArithmeticTask(demo_tool=1.5)
    with pytest.raises(ConfigError, match="task.demo_valid"):
        ToolArithmeticTask(demo_valid=-0.1)


def test_stops_split_into_token_stops_and_text_stops():
    tok = CharTokenizer()
    stops = Stops(tok, ("=", "</c>"))
    assert stops.token_ids == (ord("="),) and stops.strings == ("</c>",)
    turn = SamplingConfig(max_tokens=64)
    assert stops.sampling(turn, 9).max_tokens == 9 and stops.sampling(turn, 9).stop == ("</c>",)
    assert stops.sampling(turn, 9).as_dict()["stop"] == ["</c>"]
    ids = [ord(c) for c in "ab</c>xy"]
    assert stops.end(tok, ids) == (6, True)  # cut after the token that completes the string
    assert stops.end(tok, ids[:6]) == (6, True)
    assert stops.end(tok, [ord(c) for c in "12="]) == (3, True)  # a token stop
    assert stops.end(tok, [ord(c) for c in "ab</"]) == (4, False)
    assert stops.end(tok, []) == (0, False)
    assert "stop" not in SamplingConfig().as_dict()


def test_a_stop_the_tokenizer_cannot_produce_is_refused_naming_env_stop():
    char = build_char_tokenizer()  # the tiny model's: a character outside its alphabet is <unk>
    assert Stops(char, ("=", "==")).strings == ("==",)
    with pytest.raises(ConfigError, match=r"env.stop.*'€'.*decode to"):
        Stops(char, ("=", "€"))
