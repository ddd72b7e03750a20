"""Types of every config field, read from the code the config builds: no list of dotted keys.

A node with a ``_target_`` is checked against its target's signature: each key that names an
argument must have the argument's annotated type (``int``, ``float``, ``bool``, ``str``,
``None``, ``Literal[...]``, unions, lists of these). So the schema of ``rollout.group_size`` is
``StreamingRollout.__init__``'s ``group_size: int``, next to the rule that checks its range, and
a new constructor argument is type-checked the day it is added. The few top-level keys that
build nothing have their schema in ``RunSchema``.

A value interpolated from elsewhere (``data.minibatches: ${algo.minibatches}``) is reported
under the field a user sets (``algo.minibatches``). Annotations this cannot read (a class, a
callable, a forward reference) are not checked here; their constructors check them.
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

from modules.config.errors import ConfigError, check

CONF = Path(__file__).resolve().parents[2] / "conf"
RESERVED = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}
_SIMPLE_REF = re.compile(r"^\$\{([A-Za-z_][\w.]*)\}$")


@dataclass
class RunSchema:
    """Top-level keys of ``conf/train.yaml`` that no ``_target_`` receives."""

    seed: int
    torch_threads: int
    optimized_metric: str
    ckpt_path: str | None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _describe(hint: Any) -> str:
    if hint is int:
        return "an int"
    if hint is float:
        return "a number"
    if hint is bool:
        return "true or false"
    if hint is str:
        return "a string"
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if origin in (list, tuple, typing.Sequence, Sequence):
        return "a list"
    return getattr(hint, "__name__", str(hint))


def matches(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` (a plain config value) has type ``hint``; None when ``hint`` is not one
    this checks (then nothing is said about it)."""
    if hint is Any or hint is object:
        return True
    if hint is int:
        return _is_int(value)
    if hint is float:
        return _is_number(value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)  # True is not Literal[1]
    if origin in (typing.Union, types.UnionType):
        results = [matches(value, a) for a in args]
        if any(r is True for r in results):
            return True
        return None if any(r is None for r in results) else False
    if origin in (list, tuple, typing.Sequence, Sequence):
        if not isinstance(value, list | tuple):
            return False
        if not args or args == ((),):
            return True
        inner = args[0] if origin is not tuple or (len(args) == 2 and args[1] is Ellipsis) else None
        if inner is None:  # a fixed-length tuple
            if len(args) != len(value):
                return False
            parts = [matches(v, a) for v, a in zip(value, args)]
        else:
            parts = [matches(v, inner) for v in value]
        return None if any(p is None for p in parts) else all(parts)
    if inspect.isclass(hint) and hint.__name__ == "Tensor":
        return False  # a config value is never a tensor (``lr: float | Tensor``)
    return None  # a class, a callable, a dict, ...: the constructor's business


def _fields(target: Callable) -> tuple[dict[str, Any], set[str]]:
    """``target``'s constructor: parameter name -> annotation (unreadable ones left out), and the
    parameters whose default is None. A factory that forwards ``**kwargs`` names the class it
    forwards to in ``config_schema``; that class's fields count too (its own win)."""
    forwarded = getattr(target, "config_schema", None)
    hints, nullable = _fields(get_object(forwarded)) if isinstance(forwarded, str) else ({}, set())
    fn = target.__init__ if inspect.isclass(target) else target
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return hints, nullable
    try:
        own = {k: v for k, v in typing.get_type_hints(fn).items() if k != "return"}
    except Exception:  # one unresolvable annotation: evaluate the others one by one
        module = inspect.getmodule(target)
        namespace = {**vars(typing), **vars(types), **(vars(module) if module else {})}
        own = {}
        for name, p in params.items():
            try:
                ann = eval(p.annotation, namespace) if isinstance(p.annotation, str) else p.annotation
            except Exception:
                continue
            if ann is not inspect.Parameter.empty:
                own[name] = ann
    return {**hints, **own}, nullable | {n for n, p in params.items() if p.default is None}


def accepted_names(target: Callable) -> set[str] | None:
    """Every keyword ``target`` accepts (with what a ``config_schema`` factory forwards to); None
    when it takes any (``**kwargs`` with nowhere named to forward them)."""
    fn = target.__init__ if inspect.isclass(target) else target
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    names = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self"}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        forwarded = getattr(target, "config_schema", None)
        inner = accepted_names(get_object(forwarded)) if isinstance(forwarded, str) else None
        return None if inner is None else names | inner
    return names


def check_known_keys(node: DictConfig, path: str, target: Callable) -> None:
    """A key the target does not take (a typo, or a ``+key`` it has no use for) is refused,
    naming the field, the keys it takes and the closest one."""
    names = accepted_names(target)
    if names is None:
        return
    for key in node.keys():
        if key in RESERVED or not isinstance(key, str) or key in names:
            continue
        unknown_key(path, key, names, f"{getattr(target, '__qualname__', target)} takes")


def unknown_key(path: str, key: str, known: set[str], owner: str) -> None:
    """Refuse ``path.key``, naming the closest known key and all of them."""
    prefix = f"{path}." if path else ""
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
    raise ConfigError(f"unknown config field {prefix}{key}{hint}: {owner} {', '.join(sorted(known))}")


def _non_finite(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value] if not math.isfinite(value) else []
    if isinstance(value, list | tuple):
        return [v for item in value for v in _non_finite(item)]
    return []


def check_finite(cfg: DictConfig) -> None:
    """inf and nan are refused in every field, except where the class a node builds lists the
    field in ``accepts_infinite`` (and documents what inf means there); nan never."""
    for path, node in nodes(cfg):
        if path.split(".")[0] == "hydra":
            continue
        allowed = set(getattr(target_class(node), "accepts_infinite", ()))
        for key in node.keys():
            if OmegaConf.is_interpolation(node, key):
                continue  # checked where it is defined
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                continue
            try:
                value = plain(node[key])
            except Exception:
                continue
            bad = _non_finite(value)
            field = f"{path}.{key}" if path else str(key)
            if bad and (key not in allowed or any(math.isnan(v) for v in bad)):
                extra = " (inf: " + str(key) + " allows it, nan never)" if key in allowed else ""
                check(field, value, False, f"a finite number{extra}")


def group_options(path: str) -> list[str] | None:
    """The options of the config group at dotted ``path`` (``rollout.staleness`` ->
    conf/rollout/staleness/*.yaml), or None when ``path`` is not a group."""
    folder = CONF.joinpath(*path.split("."))
    if not folder.is_dir():
        return None
    return sorted(p.stem for p in folder.glob("*.yaml"))


def group_keys(path: str) -> set[str] | None:
    """Every key an option of the config group at ``path`` sets, with its sub-groups' names
    (``algo`` -> advantage, ..., minibatches, epochs); None when ``path`` is not a group.
    The schema of a group node that builds nothing: a key no option has is a typo."""
    import yaml

    folder = CONF.joinpath(*path.split(".")) if path else CONF
    if not folder.is_dir():
        return None
    keys = {p.name for p in folder.iterdir() if p.is_dir()}
    for option in folder.glob("*.yaml"):
        text = option.read_text()
        if "@package" in text.split("\n", 1)[0]:
            continue  # a _global_ delta: its keys live elsewhere
        keys |= set(yaml.safe_load(text) or {}) - {"defaults"}
    return keys


def check_plain_keys(cfg: DictConfig) -> None:
    """Group nodes that build nothing (``algo``, ``model``) and the top level: a key that no
    option of the group sets (``+algo.kl_coef``, ``+seedd``) is refused with the closest one."""
    for path, node in nodes(cfg):
        if "_target_" in node:
            continue
        if path == "":
            known = {p.name for p in CONF.iterdir() if p.is_dir()} | set(typing.get_type_hints(RunSchema))
        else:
            known = group_keys(path)
            if known is None:
                continue
        for key in node.keys():
            if not isinstance(key, str) or key in known or key in RESERVED:
                continue
            child = node._get_node(key)
            if isinstance(child, DictConfig) and "_target_" in child:
                continue  # an object added to the group (+callbacks.mine._target_=...)
            unknown_key(path, key, known, f"{path or 'the top level'} has")


def check_interpolations(cfg: DictConfig) -> None:
    """A value that refers to a key that does not exist (``model.path=${model.pth}``) is reported
    under the field that holds it. References only a Hydra run resolves are left alone."""
    from omegaconf.errors import InterpolationResolutionError

    for path, node in nodes(cfg):
        if path.split(".")[0] == "hydra":
            continue
        for key in node.keys():
            if not isinstance(key, str) or not OmegaConf.is_interpolation(node, key):
                continue
            try:
                node[key]
            except InterpolationResolutionError as e:
                reason = str(e).split("\n")[0]
                if "HydraConfig" in reason or "hydra" in reason:
                    continue
                raw = node._get_node(key)._value()
                field = f"{path}.{key}" if path else key
                raise ConfigError(f"invalid config value {field}={raw!r}: {reason}") from None


def check_groups(cfg: DictConfig) -> None:
    """A config group set to a plain value with a dotted override (``rollout.staleness=throttle``
    instead of ``rollout/staleness=throttle``) is refused, naming the options."""
    for path, node in nodes(cfg):
        for key in node.keys():
            if not isinstance(key, str) or OmegaConf.is_interpolation(node, key):
                continue
            field = f"{path}.{key}" if path else key
            child = node._get_node(key)
            if isinstance(child, DictConfig) or child._is_none():
                continue
            options = group_options(field)
            if options:
                group = field.replace(".", "/")
                raise ConfigError(
                    f"invalid config value {field}={node[key]!r}: {field} is a config group; "
                    f"choose one with {group}=<option> (one of {', '.join(options)})"
                )


def nodes(cfg: DictConfig, path: str = "") -> Iterator[tuple[str, DictConfig]]:
    """Every dict node reachable without following an interpolation, with its dotted path."""
    yield path, cfg
    for key in cfg.keys():
        if not isinstance(key, str) or OmegaConf.is_interpolation(cfg, key):
            continue
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            yield from nodes(child, f"{path}.{key}" if path else key)


def plain(value: Any) -> Any:
    """A config value as plain Python (lists and mappings resolved)."""
    if isinstance(value, ListConfig | DictConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def source_field(cfg: DictConfig, field: str) -> str:
    """The field a user sets for ``field``: ``model.path`` for ``module.model_path``
    (``${model.path}``), else ``field`` itself."""
    parent, _, key = field.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if isinstance(node, DictConfig) and key in node and OmegaConf.is_interpolation(node, key):
        ref = _SIMPLE_REF.match(str(node._get_node(key)._value()))
        if ref:
            return source_field(cfg, ref.group(1))
    return field


def check_fields(node: DictConfig, path: str, hints: dict[str, Any], nullable: set[str]) -> None:
    """Each key of ``node`` that ``hints`` annotates must have that type."""
    for key in node.keys():
        if key in RESERVED or key not in hints:
            continue
        field = f"{path}.{key}" if path else str(key)
        if OmegaConf.is_interpolation(node, key):
            ref = _SIMPLE_REF.match(str(node._get_node(key)._value()))
            field = ref.group(1) if ref else field
        try:
            value = node[key]
        except Exception:  # an interpolation only a Hydra run resolves
            continue
        if isinstance(value, DictConfig):
            continue  # an object (its own _target_) or a mapping: checked where it is defined
        value = plain(value)
        if value is None and key in nullable:
            continue
        ok = matches(value, hints[key])
        if ok is False:
            got = "null" if value is None else type(value).__name__
            check(field, value, False, f"{_describe(hints[key])}, not {got}")


def target_class(node: Any) -> Any:
    """The class (or function) a config node's ``_target_`` builds; None without one or when it
    does not resolve (building it then names the error). Rules ask it what it is (a class
    attribute, ``issubclass``), never its name."""
    target = node.get("_target_") if isinstance(node, DictConfig | dict) else None
    if not isinstance(target, str):
        return None
    try:
        return get_object(target)
    except Exception:
        return None


def builds(node: Any, cls: type) -> bool:
    """Whether ``node`` builds a ``cls`` (or a subclass)."""
    found = target_class(node)
    return inspect.isclass(found) and issubclass(found, cls)


def check_types(cfg: DictConfig) -> None:
    """Check every field that a ``_target_`` receives (known keys, types), the run's top-level
    keys, that no group was set to a plain value, and that no number is inf or nan."""
    check_groups(cfg)
    check_plain_keys(cfg)
    check_interpolations(cfg)
    check_fields(cfg, "", typing.get_type_hints(RunSchema), {"ckpt_path"})
    for path, node in nodes(cfg):
        target = node.get("_target_") if "_target_" in node else None
        if not isinstance(target, str):
            continue
        try:
            obj = get_object(target)
        except Exception:
            continue  # the build step names an unknown _target_ itself
        check_known_keys(node, path, obj)
        check_fields(node, path, *_fields(obj))
    check_finite(cfg)
