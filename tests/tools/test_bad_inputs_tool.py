"""tools/bad_inputs.py renders the per-class table and the as-typed sample from its rows."""

from __future__ import annotations

from tools.bad_inputs import markdown


def test_the_table_counts_refusals_per_class_and_lists_the_cli_sample():
    rows = [
        {
            "kind": "int_range",
            "overrides": ["a.b=0"],
            "field": "a.b",
            "ok": True,
            "s": 0.1,
            "text": "a.b=0 bad",
        },
        {"kind": "int_range", "overrides": ["a.c=0"], "field": "a.c", "ok": False, "s": 0.3, "text": ""},
        {"kind": "valid", "overrides": ["x=1"], "field": None, "ok": True, "s": 0.2, "text": ""},
    ]
    cli = [{**rows[0], "exit": 2, "cli_s": 7.25, "traceback": False, "engine": False}]
    text = markdown(rows, cli)
    assert "| int_range | 2 | 1 | 200 | `a.b=0` |" in text
    assert "| valid | 1 | 1 accepted |" in text
    assert "Bad inputs refused naming their field: 1 of 2." in text
    assert "| `a.b=0` | 2 | 7.2 | no | no | a.b=0 bad |" in text
