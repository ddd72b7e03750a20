"""The calculator environment of the calculator task (``data/tasks/calculator.py``): a turn
ending with ``=`` calls the tool, and its result comes back as an observation.

    python train.py recipe=sft_calculator && python train.py recipe=agent_calculator
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig

from data.envs.base import Environment, Step
from data.envs.tools import ToolRunner
from data.tasks.calculator import answer
from modules.config.errors import check

# what env.http may set (data/envs/http.py, HttpTool's fields)
HTTP_FIELDS = frozenset(("batch_size", "max_wait_s", "timeout_s", "max_consecutive_failures", "auth_env"))
CALL = re.compile(r"^(\d{1,4})([*+-])(\d{1,4})$")  # what the calculator takes


def calculate(expression: str) -> int:
    """The calculator: ``a*b``, ``a+b`` or ``a-b`` of non-negative integers."""
    match = CALL.match(expression)
    if match is None:
        raise ValueError(f"not a calculation: {expression!r}")
    a, op, b = int(match[1]), match[2], int(match[3])
    return a * b if op == "*" else a + b if op == "+" else a - b


class CalculatorEnv(Environment):
    """A turn ``c=`` calls the calculator on the question, ``c<expression>=`` on that
    expression (observation ``"{result};"``, or ``"error;"`` for a malformed call); any other
    turn is the final answer, scored 1 or 0 (``"a."`` answers with the result shown).
    ``http`` (``{batch_size, max_wait_s, timeout_s}``, or null): the calculator runs as a
    local HTTP server this environment starts, called with request batching
    (``data/envs/http.py``), as a remote tool would be."""

    def __init__(
        self,
        max_turns: int = 4,
        max_total_tokens: int | None = None,
        stop: tuple[str, ...] | list[str] = ("=",),
        tools: ToolRunner | None = None,
        max_turn_tokens: int | None = None,
        call_timeout_s: float = 60.0,
        episode_timeout_s: float | None = 600.0,
        workers: int = 16,
        http: dict[str, Any] | None = None,
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
        check(
            "env.http",
            http,
            http is None or (isinstance(http, dict | DictConfig) and set(http) <= HTTP_FIELDS),
            f"null or a mapping of {', '.join(sorted(HTTP_FIELDS))} (quote it in a shell: "
            "'env.http={batch_size:16,timeout_s:10.0}')",
        )
        self.server = self.remote = None
        self.tool: Any = calculate
        if http is not None:
            from data.envs.http import HttpTool
            from data.envs.http_server import serve

            self.server = serve(calculate)
            self.remote = HttpTool(self.server.url, **dict(http))
            self.tool = self.remote.call

    def close(self) -> None:
        super().close()
        if self.remote is not None:
            self.remote.close_io()
        if self.server is not None:
            self.server.stop()
            self.server = None

    async def step(self, state: dict, turn: str) -> Step:
        turn = turn.strip()
        if turn.endswith("="):
            expression = turn[1:-1] if turn.startswith("c") else "?"
            expression = expression or state["row"]["prompt"].rstrip("?")  # "c=": the question
            if CALL.match(expression) is None:
                state["shown"] = None  # the display shows the error
                return Step(observation="error;", info={"valid_call": False, "tool_error": False})
            result = await self.tools.call(self.tool, expression)
            state["shown"] = str(result.output) if result.ok else None
            text = f"{result.output};" if result.ok else "error;"
            return Step(observation=text, info={"valid_call": True, "tool_error": not result.ok})
        right = answer(turn, state.get("shown")) == state["row"]["answer"]
        return Step(reward=float(right), done=True)
