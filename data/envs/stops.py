"""What ends a model turn: ``env.stop`` as the engine is asked to stop and as the runner sees it.

A stop that is one token of the model's tokenizer (the character model's ``=``) goes to the
engine as a stop token id; a longer one (SmolLM2's ``</tool_call>``, five tokens) as a text
stop, which vLLM matches on its detokenized output and keeps in it. Either way the sampled ids
are kept as sampled. A turn ended by a stop is recognised from its last token (a token stop)
or from its text (a text stop); a turn whose text holds a text stop the engine did not stop at
(one written across the boundary of a turn resumed after a weight sync, or an engine that
ignores text stops) is cut after the token that completes it, as vLLM cuts a step that
samples past one.

Start-up (``check``): each stop must be text the tokenizer can produce: ``decode(encode(s))``
gives ``s`` back (a character outside the character tokenizer's alphabet does not), and a stop
of several tokens must not hold a special token (the engine's detokenizer skips those, so it
would never see the string).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from modules.config.errors import ConfigError
from modules.engine.types import SamplingConfig


def _refuse(stops: tuple[str, ...], s: str, why: str) -> ConfigError:
    return ConfigError(
        f"invalid config value env.stop={list(stops)!r}: must be strings the model's tokenizer can "
        f"produce; {s!r} {why}"
    )


class Stops:
    """``env.stop`` split by ``tokenizer`` into stop token ids and text stops (checked)."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...] | list[str]) -> None:
        stops = tuple(stops)
        token_ids: list[int] = []
        strings: list[str] = []
        for s in stops:
            ids = list(tokenizer(s, add_special_tokens=False)["input_ids"])
            back = tokenizer.decode(ids, skip_special_tokens=False)
            if back != s:
                raise _refuse(stops, s, f"encodes to {ids}, which decode to {back!r}")
            if len(ids) == 1:
                token_ids.append(int(ids[0]))
            elif tokenizer.decode(ids, skip_special_tokens=True) != s:
                raise _refuse(stops, s, "holds a special token, which the engine's detokenizer skips")
            else:
                strings.append(s)
        self.token_ids = tuple(token_ids)
        self.strings = tuple(strings)

    def sampling(self, sampling: SamplingConfig, max_tokens: int) -> SamplingConfig:
        """A model turn's sampling: ``sampling`` with the turn's cap and these stops."""
        return replace(sampling, max_tokens=max_tokens, stop_token_ids=self.token_ids, stop=self.strings)

    def end(self, tokenizer: Any, turn_ids: list[int]) -> tuple[int, bool]:
        """``(n, stopped)``: the turn keeps its first ``n`` ids (all of them, unless a text stop
        completes before its last token) and whether a stop ended it."""
        if not turn_ids:
            return 0, False
        if turn_ids[-1] in self.token_ids:
            return len(turn_ids), True
        if not self.strings or not self._holds(tokenizer, turn_ids):
            return len(turn_ids), False
        lo, hi = 1, len(turn_ids)  # the shortest prefix that holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if self._holds(tokenizer, turn_ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo, True

    def _holds(self, tokenizer: Any, ids: list[int]) -> bool:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in self.strings)
