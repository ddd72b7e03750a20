"""Tool episodes of the real chat model on the real engine: SmolLM2-135M-Instruct served by
vLLM in bf16 (as ``recipe=smollm2_tools`` serves it), calls ended by the five-token stop
string ``</tool_call>``, the observation rendered as the template's tool turn.

The trained sequence is exactly the prompt, the ids the engine sampled and the observation ids
(compared id by id with what the engine returned and was sent), and the trainer's logprob of
every sampled token matches the engine's within the bf16 tolerance of the weight-sync check
(``VERIFY_TOLERANCE``). The imported model is made to call the tool by a prompt that ends
inside a call's opening (the environment reads the turn with it), greedy and sampled.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data.envs.chat_tools import ChatCalculatorEnv, calculate
from data.envs.episodes import EpisodeRunner
from data.envs.tool_calls import ToolCall, parse_tool_call
from data.rollout.experience import Experience, collate
from data.tasks.tool_arithmetic import ToolArithmeticTask
from modules.callbacks.weight_sync import VERIFY_TOLERANCE
from modules.engine import SamplingConfig
from modules.policy.hf_policy import load_policy, token_logprobs
from modules.policy.prompt_format import ChatTemplate

pytestmark = pytest.mark.engine

SMOLLM2 = Path(__file__).resolve().parents[2] / "artifacts" / "smollm2-135m-instruct"
FORCED = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
TOOLS = {"calculator": ("expression",)}


class Forced(ChatCalculatorEnv):
    """The prompt ends inside the opening of a call: the first turn is read with it."""

    async def step(self, state: dict, turn: str):
        first = not state.get("called")
        state["called"] = True
        return await super().step(state, FORCED + turn if first else turn)


class Recording:
    """The engine, with every request's context and future kept (the sampled ids)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[tuple[list[int], SamplingConfig, object]] = []

    def submit(self, prompt_ids, sampling, **kw):
        fut = self.engine.submit(prompt_ids, sampling, **kw)
        self.calls.append((list(prompt_ids), sampling, fut))
        return fut


@pytest.fixture(scope="module")
def smol_engine():
    from modules.engine.vllm import VLLMEngine

    assert (SMOLLM2 / "config.json").is_file(), f"{SMOLLM2} is missing: run `make smollm2`"
    eng = VLLMEngine(
        str(SMOLLM2), dtype="bfloat16", max_model_len=320, max_num_seqs=8, pin_trainer=False
    ).start()
    yield eng
    eng.shutdown()


def test_tool_episodes_train_exactly_the_sampled_ids_and_the_engines_logprobs(smol_engine):
    model, tok = load_policy(SMOLLM2)
    model.eval()
    fmt, task = ChatTemplate(), ToolArithmeticTask()
    engine = Recording(smol_engine)
    runner = EpisodeRunner(engine, Forced(max_turns=2, max_turn_tokens=40), tok, prompt_format=fmt)
    forced = tok(FORCED, add_special_tokens=False)["input_ids"]
    episodes = []
    try:
        for i, (row, temperature) in enumerate(zip(task.build("eval", 2), (0.0, 0.7))):
            prompt = fmt.ids(tok, task.prompt_text(row)) + forced
            sampling = SamplingConfig(temperature=temperature, max_tokens=96)
            comp = runner.submit(prompt, row, sampling, seed=i, request_id=f"g{i}").result(timeout=300)
            episodes.append(
                (prompt, temperature, comp, [c for c in engine.calls if c[0][: len(prompt)] == prompt])
            )
    finally:
        runner.close()
    greedy_call = None
    for prompt, temperature, comp, calls in episodes:
        assert calls[0][1].stop == ("</tool_call>",) and calls[0][1].stop_token_ids == ()
        sampled = [c[2].result().token_ids for c in calls]  # what the engine returned, per turn
        engine_lps = [c[2].result().logprobs for c in calls]
        turn0 = comp.turns[0]
        if temperature == 0.0:  # the greedy call is closed by the stop string and well formed
            assert turn0["stop"] is True and turn0["valid_call"] is True and len(calls) == 2
            text = tok.decode(sampled[0], skip_special_tokens=True)
            assert text.endswith("</tool_call>") or "</tool_call>" in tok.decode(sampled[0][-1:])
            greedy_call = parse_tool_call(FORCED + text, TOOLS)
            assert isinstance(greedy_call, ToolCall)
        # token in, token out: the episode is the sampled ids and the observation ids, each
        # next context exactly the episode so far
        o_lo, o_hi = turn0["observation"]
        assert comp.token_ids[: len(sampled[0])] == sampled[0] and turn0["span"] == [0, len(sampled[0])]
        if len(calls) == 2:
            obs = comp.token_ids[o_lo:o_hi]
            assert calls[1][0] == prompt + sampled[0] + obs
            assert comp.token_ids == sampled[0] + obs + sampled[1]
            call = parse_tool_call(FORCED + tok.decode(sampled[0], skip_special_tokens=True), TOOLS)
            if isinstance(call, ToolCall):  # the observation is the template's tool turn, tokenised once
                result = str(calculate(call.arguments["expression"]))
                assert obs == tok(fmt.observation(tok, result), add_special_tokens=False)["input_ids"]
            assert comp.loss_mask == [1] * len(sampled[0]) + [0] * len(obs) + [1] * len(sampled[1])
            assert comp.logprobs == engine_lps[0] + [0.0] * len(obs) + engine_lps[1]
        # the trainer's logprob of every sampled token, on the trained sequence in one forward
        e = Experience(0, 0, 0, prompt, comp.token_ids, comp.logprobs, 0.0, 0, {}, 0.0, 1.0, False)
        e.loss_mask = comp.loss_mask
        batch = collate([e], tok.pad_token_id)
        with torch.no_grad():
            mine, _ = token_logprobs(
                model, batch["input_ids"], batch["attention_mask"], 1.0 if temperature == 0 else temperature
            )
        on = batch["loss_mask"][0] > 0
        diff = (mine[0][on] - batch["behavior_logprobs"][0][on]).abs()
        assert diff.max().item() <= VERIFY_TOLERANCE["bfloat16"], diff.max().item()
        assert diff.mean().item() < 0.1, diff.mean().item()  # bf16 rounding, not another context
    assert greedy_call is not None
