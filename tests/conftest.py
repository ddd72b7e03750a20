"""Shared fixtures: the real composed config (shrunk for tests), tiny models, one engine.

vLLM start-up costs ~20-30 s here, so the engine fixtures are session-scoped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PROJECT_ROOT", str(ROOT))

import modules.launch.compose  # noqa: E402,F401  (registers the config resolvers: project_root, run_output_dir)


def compose(overrides: list[str] | None = None, output_dir: str = "/tmp/asyncrl-test"):
    """Compose conf/train.yaml exactly as train.py does, plus overrides."""
    from modules.launch.compose import compose as compose_config

    return compose_config(overrides, output_dir)


# Small config used by every end-to-end run: few prompts, short eval, short responses.
SHRINK = [
    "trainer.max_steps=3",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.sampling.max_tokens=48",
    "data.eval_size=8",
    "data.train_size=256",
    "callbacks.eval.every_n_versions=2",
    # the engine's worker inside its core process: ~10 s less start-up per run; the tests about
    # the engine's processes pass DEFAULT_EXECUTOR after SHRINK to cover vLLM's own layout
    "engine.executor=uni",
]
DEFAULT_EXECUTOR = "engine.executor=null"


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Qwen2 models with peaky output distributions (init_std 0.3)."""
    from modules.policy.tiny_model import build_tiny_qwen

    base = tmp_path_factory.mktemp("models")
    return {
        "tied": build_tiny_qwen(base / "tied", seed=1, init_std=0.3, tie_word_embeddings=True),
        "untied": build_tiny_qwen(base / "untied", seed=2, init_std=0.3, tie_word_embeddings=False),
    }


@pytest.fixture(scope="session")
def engine(models):
    from modules.engine.vllm import VLLMEngine

    eng = VLLMEngine(str(models["tied"]), max_model_len=320, max_num_seqs=64, pin_trainer=False).start()
    yield eng
    eng.shutdown()


def pytest_configure(config) -> None:
    """On an xdist worker (``make test``), one torch thread: two workers share the two cores.
    Set here, not as OMP_NUM_THREADS, so that the train.py runs the tests start see the
    environment a user's shell has."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


_TIER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    """Time per tier (setup + call + teardown of its tests, summed over the workers that ran
    them), for the summary below."""
    parts = report.nodeid.split("/")
    tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"
    _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if _TIER_SECONDS:
        terminalreporter.write_sep("-", "seconds per tier (summed over workers)")
        for tier in ("unit", "tools", "integration", "e2e", "other"):
            if tier in _TIER_SECONDS:
                terminalreporter.write_line(f"tests/{tier}: {_TIER_SECONDS[tier]:.0f} s")
