"""GPU placement rules with faked device counts and inherited CUDA_VISIBLE_DEVICES (no GPU here)."""

from __future__ import annotations

import pytest


def test_an_unplaced_auto_engine_refuses_to_start(tmp_path):
    from modules.engine.types import EngineError
    from modules.engine.vllm import VLLMEngine

    (tmp_path / "config.json").write_text("{}")
    eng = VLLMEngine(str(tmp_path), gpu_ids="auto", cpu_cores=None)
    with pytest.raises(EngineError, match="engine.gpu_ids=auto"):
        eng.start()
    assert not eng.started
