"""Word problems with two-digit products, solved with a calculator tool called in the chat
model's own format: the multi-turn task of the real chat model (``recipe=smollm2_tools``).

    python -m data.tasks.tool_arithmetic      # a few problems and demonstrations per level

The prompt is the problem and how to call the tool. The model may answer at once, or call

    <tool_call>{"name": "calculator", "arguments": {"expression": "23*47"}}</tool_call>

(the turn ends at the stop string ``</tool_call>``); the environment (``data/envs/chat_tools.py``)
answers with the result as the template's tool turn, and the model answers in its next turn.
Levels: 0 a two-digit by one-digit product, 1 a two-digit by two-digit product, 2 such a
product and then an addition or subtraction of a two-digit number (one call on the whole
expression, or two). SmolLM2-135M cannot multiply two-digit numbers in its head; with the
tool every level is a matter of copying numbers.

Reward: 1.0 when the final answer's last number equals the reference (math-verify, as
``data/tasks/word_problems.py``), else 0.0; no format reward. The supervised warm start
(``recipe=smollm2_sft_tools``) imitates demonstrations (split ``sft``, ``demo``: the model's
turns and the tool's alternating) that call the tool in ``demo_tool`` of the episodes and
answer in their head otherwise (right ``demo_right`` of the time); ``1 - demo_valid`` of the
demonstrated calls are malformed (a wrong argument name, an unknown tool, arguments that are not
an object), answered by the environment's error and a guess: RL then has to make the call the
model's choice and the call well formed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from data.tasks import level_weights as checked_weights
from data.tasks import split_rng
from data.tasks.gsm8k import answers_match
from data.tasks.word_problems import NAMES, THINGS, draw_in_split, final_number
from modules.config.errors import check

TOOL = "calculator"
EXAMPLE_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
INSTRUCTION = (
    f"You can use a calculator: write {EXAMPLE_CALL} and its result comes back. Answer with the final number."
)


def _problem(level: int, rng: random.Random, who: str, what: str) -> tuple[str, str, int]:
    """(question, the expression that solves it, the answer)."""
    a = rng.randint(11, 99)
    b = rng.randint(3, 9) if level == 0 else rng.randint(11, 99)
    question = f"{who} buys {b} boxes with {a} {what} in each box."
    if level < 2:
        return f"{question} How many {what} does {who} buy?", f"{b}*{a}", a * b
    c = rng.randint(11, 99)
    if rng.random() < 0.5:
        return (
            f"{question} Then {who} finds {c} more. How many {what} does {who} have now?",
            f"{b}*{a}+{c}",
            a * b + c,
        )
    return (
        f"{question} Then {who} gives away {c}. How many {what} does {who} have left?",
        f"{b}*{a}-{c}",
        a * b - c,
    )


def call_text(expression: str) -> str:
    """The model's tool call as demonstrated (``data/envs/tool_calls.py`` parses it)."""
    return f"<tool_call>{json.dumps({'name': TOOL, 'arguments': {'expression': expression}})}</tool_call>"


# A weak demonstrator's malformed calls, as small models write them, and the environment's answer
# to each (``data/envs/chat_tools.py``: "Error: " + the parser's reason; a test keeps them equal).
MALFORMED: tuple[tuple[Callable[[str], Any], str], ...] = (
    (
        lambda e: {"name": TOOL, "arguments": {"expr": e}},
        "Error: calculator needs the argument 'expression'.",
    ),
    (
        lambda e: {"name": "calc", "arguments": {"expression": e}},
        "Error: unknown tool 'calc' (tools: calculator).",
    ),
    (lambda e: {"name": TOOL, "arguments": e}, 'Error: "arguments" must be a JSON object.'),
)


def answer_text(value: int | str) -> str:
    """The final answer as demonstrated."""
    return f"The answer is {value}."


def score(row: dict, text: str) -> float:
    """1.0 if the last number of ``text`` is the row's answer (math-verify), else 0.0."""
    return 1.0 if answers_match(final_number(text), row["answer"]) else 0.0


@dataclass
class ToolArithmeticTask:
    level_weights: tuple[float, ...] | list[float] = (1.0, 1.0, 1.0)
    demo_tool: float = 0.5  # share of demonstrations that call the calculator
    demo_right: float = 0.3  # share of direct (no tool) demonstrations that are right
    demo_valid: float = 0.25  # share of the demonstrations' calls that are well formed
    seed: int = 0
    name: str = "tool_arithmetic"

    def __post_init__(self) -> None:
        self.level_weights = checked_weights(self.level_weights, 3)
        check("task.demo_tool", self.demo_tool, 0.0 <= self.demo_tool <= 1.0, "a float in [0, 1]")
        check("task.demo_right", self.demo_right, 0.0 <= self.demo_right <= 1.0, "a float in [0, 1]")
        check("task.demo_valid", self.demo_valid, 0.0 <= self.demo_valid <= 1.0, "a float in [0, 1]")
        check("task.seed", self.seed, isinstance(self.seed, int), "an int")

    def build(self, split: str, size: int, level_weights: tuple[float, ...] | None = None) -> list[dict]:
        """``size`` rows of ``split`` (``train`` / ``eval`` / ``sft``), each split its own seed,
        ``eval`` disjoint from the others by question text (``word_problems.draw_in_split``); ``sft``
        rows carry a demonstration (``demo``)."""
        rng = split_rng(split, self.seed, salt=313)
        weights = self.level_weights if level_weights is None else tuple(level_weights)
        rows = []
        for i in range(size):
            level = rng.choices(range(3), weights=weights)[0]
            question, expression, answer = draw_in_split(  # redrawn within the level
                lambda level=level: _problem(level, rng, rng.choice(NAMES), rng.choice(THINGS)), split
            )
            row: dict[str, Any] = {"id": i, "level": level, "question": question, "answer": str(answer)}
            row["expression"] = expression
            if split == "sft":
                row["demo"] = self.demonstrate(expression, answer, rng)
            rows.append(row)
        return rows

    def demonstrate(self, expression: str, answer: int, rng: random.Random) -> list[str]:
        """The model's turns and the tool's outputs, alternating (the outputs are context, not
        loss, in the warm start: ``data/sft_data.py``). A malformed call (``1 - demo_valid`` of
        the calls) gets the environment's error and an answer from the head, like a direct one."""
        guess = self._guess(answer, rng)
        if rng.random() < self.demo_tool:
            if rng.random() < self.demo_valid:
                return [call_text(expression), str(answer), answer_text(answer)]
            call, error = rng.choice(MALFORMED)
            return [f"<tool_call>{json.dumps(call(expression))}</tool_call>", error, answer_text(guess)]
        return [answer_text(guess)]

    def _guess(self, answer: int, rng: random.Random) -> int:
        """An answer from the head: right ``demo_right`` of the time, else off by a typical slip."""
        right = rng.random() < self.demo_right
        return answer if right else answer + rng.choice((-20, -10, -2, 1, 10, 30))

    def prompt_text(self, row: dict) -> str:
        return f"{row['question']} {INSTRUCTION}"

    def reward(self, row: dict, response: str) -> float:
        """The one-turn reward (no tool ran): the last number of the response."""
        return score(row, response)


if __name__ == "__main__":
    task = ToolArithmeticTask()
    for row in task.build("sft", 6):
        print(row["level"], task.prompt_text(row), "->", row["answer"], row["demo"])
