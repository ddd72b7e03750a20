"""Every config path an error message names exists: in a composed config, or as a constructor
argument of the ``_target_`` at its parent.

The fields are read from the source: the first argument of each ``check`` / ``check_choice``
call, and every ``<group>.<key>=`` inside a ``raise`` in ``modules/`` and ``data/``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re

import pytest
from omegaconf import DictConfig, OmegaConf

from tests.conftest import ROOT, compose

GROUPS = "algo|rollout|engine|data|module|trainer|task|callbacks|model|paths"

IN_MESSAGE = re.compile(rf"\b((?:{GROUPS})(?:\.[a-z_]+)+)=")

VARIANTS = [
    [],
    ["rollout=streaming"],
    ["rollout=partial"],
    ["rollout=streaming", "rollout/selection=stratified"],
    *[
        ["rollout=streaming", f"rollout/staleness={p.stem}"]
        for p in (ROOT / "conf/rollout/staleness").glob("*.yaml")
    ],
    ["algo/advantage=running"],
    ["callbacks/drift=controller"],
    *[[f"module/forward={p.stem}"] for p in sorted((ROOT / "conf/module/forward").glob("*.yaml"))],
    ["engine=vllm_gpu"],
    ["recipe=sft_warmup"],
    ["recipe=gsm8k_grpo"],
    ["recipe=math_grpo"],
    ["recipe=dapo"],
    ["recipe=ppo"],
    ["recipe=agent_calculator"],
    ["recipe=smollm2_tools"],
    ["recipe=agent_calculator", "env.tools.latency._target_=data.envs.tools.LogNormal"],
    ["recipe=agent_calculator", "env.tools.latency._target_=data.envs.tools.Trace"],
    [
        "recipe=agent_calculator",
        "env.http={batch_size:16,max_wait_s:0.005,timeout_s:10.0,max_consecutive_failures:20,auth_env:null}",
    ],
    ["recipe=gsm8k_grpo", "task=judged_gsm8k"],
    ["rollout/overlong=filter"],
    ["trainer=fsdp_cpu"],
    *[[f"algo/correction={p.stem}"] for p in sorted((ROOT / "conf/algo/correction").glob("*.yaml"))],
    *[[f"algo/objective={p.stem}"] for p in sorted((ROOT / "conf/algo/objective").glob("*.yaml"))],
]


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):  # keep the literal parts; "{x}" becomes "*"
        return ["".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)]
    return [s for child in ast.iter_child_nodes(node) for s in _strings(child)]


def named_fields() -> dict[str, str]:
    """Config path -> where it is named (file:line)."""
    fields: dict[str, str] = {}
    for pkg in ("modules", "data"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("check", "check_choice"):
                    for text in _strings(node.args[0]):
                        fields.setdefault(text, where)
                elif isinstance(node, ast.Raise) and node.exc is not None:
                    for text in _strings(node.exc):
                        for m in IN_MESSAGE.finditer(text):
                            fields.setdefault(m.group(1), where)
    return fields


FIELDS = named_fields()

CONFIGS = [compose(v) for v in VARIANTS]

_MISSING = object()


def resolves(cfg: DictConfig, field: str) -> bool:
    parts = field.split(".")
    if "*" in field:  # a field built at run time: its fixed prefix must be a config node
        prefix = ".".join(parts[: next(i for i, p in enumerate(parts) if "*" in p)])
        return isinstance(OmegaConf.select(cfg, prefix), DictConfig)
    if OmegaConf.select(cfg, field, default=_MISSING) is not _MISSING:
        return True
    parent = OmegaConf.select(cfg, ".".join(parts[:-1]))
    target = parent.get("_target_") if isinstance(parent, DictConfig) else None
    if not target:
        return False
    module, _, name = target.rpartition(".")
    obj = getattr(importlib.import_module(module), name)
    return parts[-1] in inspect.signature(obj).parameters


def test_messages_name_fields():
    assert len(FIELDS) >= 60, sorted(FIELDS)
    assert "algo.loss.aggregation" in FIELDS and "rollout.group_size" in FIELDS


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_named_field_exists_in_the_config(field):
    assert any(resolves(cfg, field) for cfg in CONFIGS), f"{field} (named at {FIELDS[field]})"


def test_a_wrong_field_is_caught():
    assert not any(resolves(cfg, "algo.aggregation") for cfg in CONFIGS)
    assert not any(resolves(cfg, "algo.kl.kind") for cfg in CONFIGS)
