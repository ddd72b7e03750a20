"""Config types read from the code the config builds (``modules/config/schema.py``).

Hand cases of the type matcher, the field a message names (the one a user sets, through an
interpolation), a constructor argument added later being checked without any list to edit,
and the rules asking classes what they are instead of reading their names.
"""

from __future__ import annotations

import ast
import re
from typing import Literal

import pytest
from omegaconf import OmegaConf

from modules.config.errors import ConfigError
from modules.config.schema import builds, check_types, matches, target_class
from tests.conftest import ROOT, compose


@pytest.mark.parametrize(
    ("value", "hint", "expected"),
    [
        (3, int, True),
        (3.0, int, False),
        (True, int, False),  # a bool is not a count
        (3, float, True),  # an int is a fine number
        ("3", float, False),
        (None, int | None, True),
        ("auto", int | str, True),
        ("auto", Literal["auto"] | int, True),
        ("fast", Literal["auto"] | int, False),
        (1, Literal["a", "b"], False),
        ([1, 2], list[int], True),
        ([1, 2.5], list[int], False),
        ([0.9, 0.99], tuple[float, float], True),
        ([0.9], tuple[float, float], False),
        (object(), object, True),
    ],
)
def test_matches_by_hand(value, hint, expected):
    assert matches(value, hint) is expected


def test_an_unknown_annotation_says_nothing():
    class Thing:
        pass

    assert matches("x", Thing) is None
    assert matches("x", int | Thing) is None  # one unknown member: not rejected


class Example:
    """Stands for any project class: a new argument is checked with no list to edit."""

    def __init__(self, count: int, share: float = 0.5, mode: Literal["a", "b"] = "a", cap: int | None = None):
        pass


def _cfg(**node):
    return OmegaConf.create(
        {"seed": 0, "torch_threads": 1, "optimized_metric": "m", "ckpt_path": None, "task": node}
    )


def test_a_new_constructor_argument_is_type_checked():
    target = f"{__name__}.Example"
    check_types(_cfg(_target_=target, count=2, share=1, mode="b", cap=None))
    for bad, field in [
        ({"count": 2.5}, "task.count"),
        ({"share": "x"}, "task.share"),
        ({"mode": "c"}, "task.mode"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(field)) as info:
            check_types(_cfg(_target_=target, **{"count": 2, **bad}))
        assert "must be" in str(info.value)
    with pytest.raises(ConfigError, match="one of a, b"):
        check_types(_cfg(_target_=target, count=1, mode="z"))


def test_an_interpolated_value_is_reported_where_the_user_sets_it():
    with pytest.raises(ConfigError, match=r"algo\.minibatches=2\.0"):
        check_types(compose(["algo.minibatches=2.0"]))


def test_top_level_keys_have_a_schema():
    with pytest.raises(ConfigError, match="seed"):
        check_types(compose(["seed=abc"]))


def test_every_shipped_recipe_passes():
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        check_types(compose([f"recipe={path.stem}"]))


def test_rules_ask_the_class_not_its_name():
    from data.rollout.staleness import Recompute, StalenessPolicy, recompute_needs_bypass_anchor
    from data.rollout.sync import SyncRollout
    from modules.algo.corrections import NoCorrection
    from modules.policy.policy_gradient import PolicyGradientModule

    cfg = compose([])
    assert target_class(cfg.module) is PolicyGradientModule and PolicyGradientModule.needs_engine
    assert not target_class(compose(["recipe=sft_warmup"]).module).needs_engine
    assert builds(cfg.algo.correction, NoCorrection)
    assert target_class(cfg.rollout) is SyncRollout and SyncRollout.barrier
    assert (
        recompute_needs_bypass_anchor in Recompute.cross_field_rules and not StalenessPolicy.cross_field_rules
    )
    assert target_class({"_target_": "no.such.Thing"}) is None
    # and nowhere in the library is a class recognised by the end of its _target_ string
    pattern = re.compile(r"endswith\(\s*[\"']\.?[A-Z][A-Za-z0-9]+[\"']")
    offenders = [
        str(p.relative_to(ROOT))
        for pkg in ("modules", "data")
        for p in (ROOT / pkg).rglob("*.py")
        if pattern.search(p.read_text()) and "worker_extension" not in p.name  # vLLM layer names
    ]
    assert not offenders, offenders


def test_no_list_of_dotted_config_keys_in_the_checks():
    """Types come from signatures; a tuple of 'group.key' strings is what schema.py replaced."""
    dotted = re.compile(r"^(algo|rollout|engine|data|module|trainer|task|callbacks|model)\.[\w.]+$")
    for path in (ROOT / "modules" / "launch").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List):
                keys = [
                    e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
                ]
                assert sum(bool(dotted.match(k)) for k in keys) < 3, (path.name, keys)


@pytest.mark.parametrize("cores", ["engine.cpu_cores=2", "engine.cpu_cores=0-1", "engine.cpu_cores=[0,1]"])
def test_engine_core_specs_of_every_documented_form_pass(cores):
    """An int core, a range, or one spec per replica (engine.replicas=2)."""
    check_types(compose(["engine.replicas=2", cores]))
