"""The prompt stream: an endless shuffled pass over the task's train split, checkpointed."""

from __future__ import annotations

import random
from typing import Any


class PromptStream:
    """Endless shuffled pass over the train split; its cursor is checkpointed.

    ``requeue`` puts prompts back at the front (those of groups still generating or buffered
    when a checkpoint was taken), so a resumed run neither loses nor repeats them.
    """

    def __init__(self, rows: list[dict], seed: int = 0) -> None:
        self.rows = rows
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._order = self._shuffle()
        self._front: list[int] = []  # row indexes served before the shuffled order
        self._index = {id(r): i for i, r in enumerate(rows)}

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 7919 + self.epoch).shuffle(order)
        return order

    def requeue(self, row_indexes: list[int]) -> None:
        self._front = list(row_indexes) + self._front

    def index_of(self, row: dict) -> int:
        return self._index[id(row)]

    def next(self) -> dict:
        if self._front:
            return self.rows[self._front.pop(0)]
        if self.cursor >= len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._shuffle()
        row = self.rows[self._order[self.cursor]]
        self.cursor += 1
        return row

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "front": list(self._front)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._front = [int(i) for i in state.get("front", [])]
        self._order = self._shuffle()
