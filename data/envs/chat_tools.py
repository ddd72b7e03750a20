"""A calculator tool called in the chat model's own format (``data/envs/tool_calls.py``), for
the tool task of the real chat model (``data/tasks/tool_arithmetic.py``).

A model turn that ends at ``</tool_call>`` (a text stop of five SmolLM2 tokens) is a call: a
well-formed one runs the calculator through ``self.tools`` and its result is the observation;
a malformed one (not JSON, an unknown tool, no expression, arguments that are not an object,
no closing tag) is answered with what was wrong and counted (``valid_call=False``). The runner renders either as the chat
template's tool turn (``model.prompt_format.observation``). A turn without a call is the final
answer: the episode ends, scored 1.0 if its last number is the answer.

    make smollm2
    python train.py recipe=smollm2_sft_tools
    python train.py recipe=smollm2_tools
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from data.envs.base import Environment, Step
from data.envs.tool_calls import Malformed, parse_tool_call
from data.envs.tools import ToolRunner
from data.tasks.tool_arithmetic import TOOL, score

TOOLS = {TOOL: ("expression",)}  # each tool's required arguments
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: Any) -> int:
    """``+``, ``-``, ``*`` and parentheses over integers below 10^6 (64 characters at most)."""
    if not isinstance(expression, str) or len(expression) > 64:
        raise ValueError("the expression must be a string of at most 64 characters")

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value < 10**6:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    try:
        tree = ast.parse(expression.replace("x", "*").replace("\u00d7", "*"), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    return value(tree.body)


class ChatCalculatorEnv(Environment):
    """The calculator as a chat-format tool; ``stop`` defaults to ``</tool_call>``."""

    def __init__(
        self,
        max_turns: int = 3,
        max_total_tokens: int | None = None,
        stop: tuple[str, ...] | list[str] = ("</tool_call>",),
        tools: ToolRunner | None = None,
        max_turn_tokens: int | None = None,
        call_timeout_s: float = 60.0,
        episode_timeout_s: float | None = 600.0,
        workers: int = 16,
    ) -> None:
        super().__init__(
            max_turns,
            max_total_tokens,
            stop,
            tools,
            max_turn_tokens,
            call_timeout_s,
            episode_timeout_s,
            workers,
        )

    async def step(self, state: dict, turn: str) -> Step:
        call = parse_tool_call(turn, TOOLS)
        if call is None:  # no call: the final answer
            return Step(reward=score(state["row"], turn), done=True)
        if isinstance(call, Malformed):
            return Step(observation=f"Error: {call.reason}.", info={"valid_call": False, "tool_error": False})
        result = await self.tools.call(calculate, call.arguments["expression"])
        return Step(observation=str(result.output), info={"valid_call": True, "tool_error": not result.ok})
