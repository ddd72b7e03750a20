"""The unit tier's contract, enforced: no engine and no subprocess.

Every test here runs in this process: starting a process (``subprocess``, ``multiprocessing``)
or a vLLM engine fails the test, which then belongs in ``tests/integration`` or ``tests/e2e``.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a unit test started a process: move it to tests/integration or tests/e2e")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    from modules.engine.vllm import VLLMEngine

    monkeypatch.setattr(VLLMEngine, "start", refuse)
