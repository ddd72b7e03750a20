"""The adversarial command lines of ``docs/bad_inputs.yaml`` (bad ones, and valid but
unusual) through train.py's start-up, in-process: each bad one is refused before any engine
or model is built, with one message naming its field; each valid one passes. The e2e tier
runs two of them as a user types them (exit code 2, no traceback: tests/e2e/test_config.py).
"""

from __future__ import annotations

import sys

import lightning as L
import pytest
import yaml
from hydra.errors import ConfigCompositionException, OverrideParseException

from modules.config.errors import ConfigError
from modules.launch.cli import message
from modules.launch.start import build_run
from tests.conftest import ROOT, compose


def load_table() -> tuple[list[tuple[str, list[str], str]], list[list[str]]]:
    """``docs/bad_inputs.yaml``: BAD as (input class, overrides, field), GOOD as override lists."""
    table = yaml.safe_load((ROOT / "docs" / "bad_inputs.yaml").read_text())
    return [(e["class"], e["overrides"], e["field"]) for e in table["bad"]], table["good"]


BAD, GOOD = load_table()


def start_up(overrides: list[str], model: str | None = None) -> None:
    """What train.py does before ``fit`` (``build_run``): nothing here builds an engine or loads
    a model. ``model``: the model path unless the overrides set one (a clean checkout has no
    artifacts/ until `make sft`)."""
    _, _, trainer = build_run(compose([f"model.path={model}", *overrides] if model else overrides))
    assert isinstance(trainer, L.Trainer)


@pytest.mark.parametrize(("kind", "overrides", "field"), BAD, ids=[" ".join(o) for _, o, _ in BAD])
def test_a_bad_command_line_is_refused_naming_its_field(kind, overrides, field, monkeypatch, models):
    monkeypatch.setattr(sys, "argv", ["train.py", *overrides])  # what cli.message quotes
    with pytest.raises((ConfigError, ConfigCompositionException, OverrideParseException)) as info:
        start_up(overrides, str(models["tied"]))
    text = message(info.value)
    assert field in text, f"{kind}: {text}"


@pytest.mark.parametrize("overrides", GOOD, ids=[" ".join(o) for o in GOOD])
def test_a_valid_unusual_command_line_passes(overrides, models):
    start_up(overrides, str(models["tied"]))
