"""docs/architecture.md names every library file, and every file it names exists."""

from __future__ import annotations

import re

from tests.conftest import ROOT

DOC = ROOT / "docs" / "architecture.md"


def library_files() -> list[str]:
    """Every non-empty .py file of modules/ and data/, as a path from the repository root."""
    return sorted(
        str(p.relative_to(ROOT))
        for pkg in ("modules", "data")
        for p in (ROOT / pkg).rglob("*.py")
        if p.read_text().strip()
    )


def test_every_library_file_is_in_the_concept_table():
    text = DOC.read_text()
    missing = [f for f in library_files() if f"`{f}`" not in text]
    assert not missing, f"add to docs/architecture.md: {missing}"


def test_every_file_the_doc_names_exists():
    named = set(
        re.findall(r"`((?:modules|data|tools|lab|tests|docs)/[\w/]+\.(?:py|md|yaml))`", DOC.read_text())
    )
    assert named
    assert not sorted(f for f in named if not (ROOT / f).exists())


def test_the_line_count_given_for_train_py_is_its_own():
    import re as _re

    lines = len((ROOT / "train.py").read_text().splitlines())
    for doc in (DOC, ROOT / "README.md"):
        counts = _re.findall(r"\((\d+) lines\)", doc.read_text())
        assert counts and all(int(c) == lines for c in counts), (doc, counts, lines)
