"""The layout the project keeps: a short entry point, small files, YAML-only recipes, and a
data path that reads one way with no import cycle.

Imports are read from the source (``ast``), function-level ones included, so a cycle hidden
by a late import is still found.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("modules", "data", "tools", "lab")


def project_files() -> dict[str, Path]:
    """Dotted module name -> file, for train.py and every package file."""
    files = {"train": ROOT / "train.py"}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def imports_of(path: Path, known: set[str], root: Path = ROOT) -> set[str]:
    """Project modules ``path`` imports (``from a.b import c`` counts a.b.c when it is a module;
    a relative import is resolved against the file's package)."""
    out = set()
    parts = path.relative_to(root).with_suffix("").parts
    package = parts[:-1]  # an __init__.py's package is its folder, like a module's
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                base = ".".join([*up, *([base] if base else [])])
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known}
    return out


def import_graph() -> dict[str, set[str]]:
    files = project_files()
    known = set(files)
    return {name: imports_of(path, known) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a list of modules (first == last), or None. Package ``__init__`` re-exports
    of their own submodules are edges like any other."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_data_path_reads_one_way():
    """The module and the engine never reach into the data side; tasks and the engine do
    not know about rollout controllers."""
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("modules"):
            assert not {d for d in deps if d.startswith("data")}, (name, deps)
        if name.startswith(("data.tasks", "modules.engine")):
            assert not {d for d in deps if d.startswith("data.rollout")}, (name, deps)


def test_entry_point_and_files_stay_small():
    """train.py stays short, and no file outside tests/ (library, tools, lab) passes 400 lines."""
    # 65: the training stack's imports sit inside train() (spawned processes re-import the file)
    assert len((ROOT / "train.py").read_text().splitlines()) <= 65
    big = {
        name: n for name, path in project_files().items() if (n := len(path.read_text().splitlines())) > 400
    }
    assert not big, big


def test_recipes_hold_yaml_only():
    recipes = [p for p in (ROOT / "recipes").iterdir() if p.name != "__pycache__"]
    assert recipes and all(p.suffix == ".yaml" for p in recipes), recipes


def test_library_and_unit_tests_never_import_tools_or_lab():
    """tools/ and lab/ sit on top of the library; the unit tier tests the library alone."""
    graph = import_graph()
    library = {n: d for n, d in graph.items() if n == "train" or n.startswith(("modules", "data"))}
    for name, deps in library.items():
        assert not {d for d in deps if d.startswith(("tools", "lab", "benchmarks"))}, (name, deps)
    for path in (ROOT / "tests" / "unit").rglob("*.py"):
        mods = top_level_imports(path)
        assert not mods & {"tools", "lab", "benchmarks"}, (path, mods)


def top_level_imports(path: Path) -> set[str]:
    """The top-level names of every absolute import in ``path`` (``from a.b import c``: a)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_no_two_library_modules_share_a_file_name():
    names: dict[str, list[str]] = {}
    for pkg in ("modules", "data"):
        for p in (ROOT / pkg).rglob("*.py"):
            if p.name not in ("__init__.py", "__main__.py"):
                names.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert not {n: ps for n, ps in names.items() if len(ps) > 1}


# Import order inside the library, bottom first: a module imports only from a lower layer or
# its own package. config/ holds what every layer imports (errors, typed schema, budgets,
# external ranges, resources); data/ sits on modules/ (tasks below environments below the
# rollout that drives both); launch/ (compose, cross-field validation, preflight, guard,
# multirun) is on top of all.
LAYERS = {
    "modules.config": 0,
    "modules.algo": 1,
    "modules.engine": 1,
    "modules.policy": 2,
    "modules.callbacks": 3,
    "data.tasks": 5,
    "data.envs": 6,
    "data.sft_data": 7,
    "data.rollout": 7,
    "modules.launch": 8,  # on top: it builds the whole run (it imports no data/ module by name)
}


def layer_of(name: str) -> str | None:
    return next((pkg for pkg in LAYERS if name == pkg or name.startswith(pkg + ".")), None)


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a library module imports from a higher layer or from a
    sibling package of the same layer."""
    out = []
    for name, deps in graph.items():
        own = layer_of(name)
        if own is None:
            continue
        for dep in deps:
            other = layer_of(dep)
            if other is not None and other != own and LAYERS[other] >= LAYERS[own]:
                out.append((name, dep))
    return sorted(out)


def test_layers_cover_the_library():
    names = [n for n in project_files() if n.startswith(("modules.", "data."))]
    assert not [n for n in names if layer_of(n) is None]
    assert {p.name for p in (ROOT / "modules").iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        pkg.split(".")[1] for pkg in LAYERS if pkg.startswith("modules.")
    }


def test_imports_of_resolves_relative_imports(tmp_path):
    file = tmp_path / "modules" / "algo" / "probe.py"
    file.parent.mkdir(parents=True)
    file.write_text("from ..launch import validate\nfrom . import losses\n")
    found = imports_of(file, set(project_files()), root=tmp_path)
    assert {"modules.launch.validate", "modules.algo.losses"} <= found


def test_policy_flag_finder_reads_annotated_flags():
    tree = "class P:\n    drops: ClassVar[bool] = True\n    def holds_bound(self) -> bool:\n        return True\n"
    assert policy_flag_names(tree) == {"drops", "holds_bound"}


def test_upward_import_finder_finds_one():
    graph = {"modules.config.errors": {"modules.launch.validate"}, "data.tasks.x": {"modules.config.errors"}}
    assert upward_imports(graph) == [("modules.config.errors", "modules.launch.validate")]
    assert upward_imports({"modules.algo.a": {"modules.engine.b"}}) == [
        ("modules.algo.a", "modules.engine.b")
    ]


def test_no_upward_import_inside_modules_or_data():
    assert upward_imports(import_graph()) == []


def test_tasks_do_not_import_envs():
    """A task is rows and a reward; the environment that runs episodes on it imports the task."""
    graph = import_graph()
    assert not {
        n: d
        for n, d in graph.items()
        if n.startswith("data.tasks") and any(x.startswith("data.envs") for x in d)
    }


def test_tools_and_lab_never_import_tests():
    files = {n: p for n, p in project_files().items() if n.startswith(("tools", "lab"))}
    assert files
    assert not [n for n, p in files.items() if "tests" in top_level_imports(p)]


def config_targets() -> dict[str, set[str]]:
    """Config group (a folder of conf/) -> the ``_target_`` classes its YAML files name."""
    import yaml

    def walk(node: object) -> list[str]:
        if isinstance(node, dict):
            own = [node["_target_"]] if isinstance(node.get("_target_"), str) else []
            return own + [t for v in node.values() for t in walk(v)]
        if isinstance(node, list):
            return [t for v in node for t in walk(v)]
        return []

    groups: dict[str, set[str]] = {}
    for group in sorted(p for p in (ROOT / "conf").iterdir() if p.is_dir()):
        for path in group.rglob("*.yaml"):
            groups.setdefault(group.name, set()).update(walk(yaml.safe_load(path.read_text()) or {}))
    return groups


def test_library_packages_mirror_the_config_groups():
    """Every package of modules/ and data/ is what some config group of conf/ builds (config/
    and launch/ excepted: they check and launch, nothing configures them), every library
    ``_target_`` of conf/ names a class that is in the library, and modules/ has no loose files."""
    loose = [p.name for p in (ROOT / "modules").glob("*.py") if p.name != "__init__.py"]
    assert not loose, loose
    files = project_files()
    targets = {t for ts in config_targets().values() for t in ts if t.startswith(("modules.", "data."))}
    assert targets
    assert not [t for t in targets if t.rsplit(".", 1)[0] not in files], "a _target_ names a missing module"
    homes = {layer_of(t) for t in targets}
    packages = {pkg for pkg in LAYERS if (ROOT / pkg.replace(".", "/")).is_dir()}
    assert packages - {"modules.config", "modules.launch"} <= homes, packages - homes


def policy_flags() -> set[str]:
    return policy_flag_names((ROOT / "data/rollout/staleness.py").read_text())


def policy_flag_names(source: str) -> set[str]:
    """Names of what a staleness policy answers with a constant (``data/rollout/staleness.py``):
    class attributes holding a bool, and methods that return True or False in every class that
    defines them (a decision computed in some class, like ``may_start``, is not a flag)."""
    flags, computed = set(), set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            value = getattr(item, "value", None)
            if isinstance(item, ast.Assign | ast.AnnAssign) and isinstance(value, ast.Constant):
                if isinstance(value.value, bool):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    flags |= {t.id for t in targets if isinstance(t, ast.Name)}
            if isinstance(item, ast.FunctionDef):
                returns = [n for n in ast.walk(item) if isinstance(n, ast.Return)]
                constant = all(
                    isinstance(r.value, ast.Constant) and isinstance(r.value.value, bool) for r in returns
                )
                (flags if returns and constant else computed).add(item.name)
    return flags - computed


def test_no_staleness_policy_flag_is_read_outside_its_file():
    """Each staleness policy owns its decisions: nothing else branches on what a policy is."""
    flags = policy_flags()
    assert {"holds_bound", "discards_past_bound", "counts_versions"} <= flags
    readers = []
    for path in [*project_files().values(), *(ROOT / "tests").rglob("*.py")]:
        if path == ROOT / "data/rollout/staleness.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in flags:
                readers.append((str(path.relative_to(ROOT)), node.attr))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr":
                args = node.args
                if len(args) > 1 and isinstance(args[1], ast.Constant) and args[1].value in flags:
                    readers.append((str(path.relative_to(ROOT)), args[1].value))
    assert not readers, readers


def test_every_cross_field_rule_is_listed_where_validate_runs_it():
    """A function documented as a "Cross-field rule" runs: it is in ``validate.CROSS_FIELD_RULES``
    or in a class's ``cross_field_rules`` (found through ``validate.RULE_HOLDERS``)."""
    from modules.launch.validate import CROSS_FIELD_RULES

    listed = {f.__name__ for f in CROSS_FIELD_RULES}
    rules, attached = {}, set()
    for name, path in project_files().items():
        if not name.startswith(("modules", "data")):
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if doc and doc.startswith("Cross-field rule"):
                rules[node.name] = name
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "cross_field_rules" for t in targets):
                    attached |= {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
    assert len(rules) >= 10
    assert not {r: m for r, m in rules.items() if r not in listed | attached}
