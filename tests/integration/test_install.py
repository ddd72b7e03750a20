"""``pip install -e .`` works: the library's packages (modules/, data/) are found and import
from anywhere, as a user who installs the repository into their own environment sees them."""

from __future__ import annotations

import subprocess
import sys

import tomllib
from setuptools import find_packages

from tests.conftest import ROOT


def test_pyproject_finds_every_library_package():
    """Every folder of modules/ and data/ that holds Python files is a package the install ships."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    found = set(find_packages(where=str(ROOT), include=find["include"]))
    folders = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for pkg in ("modules", "data")
        for p in (ROOT / pkg).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert folders and found == folders


def test_an_editable_install_imports_from_another_directory(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    probe = (
        "import importlib.util as u, modules.config.errors as e; "
        "print(e.__file__); print(u.find_spec('data.rollout.staleness').origin); "
        "print(u.find_spec('data.envs.calculator_env').origin)"
    )
    out = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    paths = out.stdout.split()
    assert len(paths) == 3 and all(p.startswith(str(ROOT)) for p in paths), out.stdout
