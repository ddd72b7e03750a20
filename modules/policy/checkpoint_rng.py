"""Random-number-generator states for checkpoints (Python, NumPy, torch CPU and CUDA).

Lightning saves model, optimizer and loop state but not the global RNGs; a resumed run
restores these so anything drawing from them (dropout, user reward code) continues the same
stream. States are kept as plain lists and tensors so checkpoints load with ``weights_only``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def python_state(state: tuple) -> list:
    """``random.getstate()`` (or ``Random.getstate()``) as nested lists."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def python_state_tuple(state: list) -> tuple:
    """The inverse of :func:`python_state`, for ``setstate``."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def rng_states() -> dict[str, Any]:
    """Snapshot of the process's global random number generators."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": python_state(random.getstate()),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore a snapshot taken by :func:`rng_states`."""
    random.setstate(python_state_tuple(states["python"]))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(states["torch"].cpu())
    if "cuda" in states and torch.cuda.is_available():
        # one state per GPU visible when saved; restore those that are visible now
        for i, state in enumerate(states["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, i)
