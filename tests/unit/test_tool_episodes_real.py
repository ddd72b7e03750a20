"""Tool episodes with the real chat model's tokenizer (SmolLM2-135M-Instruct: BPE, ChatML):
the stop string ``</tool_call>`` (five tokens), the observation as the template's tool turn,
and token in / token out: what is trained is exactly what the engine sampled plus the
observation ids. Then the two views of one conversation, the appended ids an episode trains on
and ``apply_chat_template`` of the whole conversation: equal where docs/envs.md says they are,
different where it says they differ. A scripted engine stands in for vLLM and emits real ids
(the real engine: tests/integration/test_tool_episodes_engine.py). Seconds: the tokenizer only.
"""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import pytest

from data.envs.chat_tools import ChatCalculatorEnv
from data.envs.episodes import EpisodeRunner
from data.envs.stops import Stops
from data.rollout.experience import Experience, collate
from data.sft_data import demonstration_ids
from data.tasks.tool_arithmetic import ToolArithmeticTask, answer_text, call_text
from modules.config.errors import ConfigError
from modules.engine.types import Completion, SamplingConfig
from modules.policy.prompt_format import ChatTemplate

SMOLLM2 = Path(__file__).resolve().parents[2] / "artifacts" / "smollm2-135m-instruct"
ROW = {"id": 0, "level": 1, "question": "Mia buys 23 boxes with 47 shells in each box.", "answer": "1081"}
CALL = call_text("23*47")
FMT = ChatTemplate()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    assert (SMOLLM2 / "tokenizer.json").is_file(), f"{SMOLLM2} is missing: run `make smollm2`"
    return AutoTokenizer.from_pretrained(SMOLLM2)


def enc(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


class ScriptedIds:
    """Answers request k of an episode with ``turns[k]`` (ids), stopping as vLLM does: after
    EOS, or after the token that completes a stop string (unless ``honour_stops`` is off, as
    for an engine that ignores text stops), or at ``max_tokens``."""

    concurrency = None
    version = 0

    def __init__(self, tok, turns: list[list[int]], honour_stops: bool = True) -> None:
        self.tok, self.turns, self.honour_stops = tok, turns, honour_stops
        self.contexts: list[list[int]] = []
        self.samplings: list[SamplingConfig] = []

    def submit(self, prompt_ids, sampling, seed=None, request_id=None, prompt_logprobs=False):
        script = self.turns[len(self.contexts)]
        self.contexts.append(list(prompt_ids))
        self.samplings.append(sampling)
        out, reason = [], "length"
        for t in script[: sampling.max_tokens]:
            out.append(t)
            text = self.tok.decode(out, skip_special_tokens=True)
            if t == self.tok.eos_token_id or (self.honour_stops and any(s in text for s in sampling.stop)):
                reason = "stop"
                break
        fut: cf.Future = cf.Future()
        fut.set_result(
            Completion(request_id or "r", list(prompt_ids), out, [-0.25] * len(out), reason, 0.0, 1.0)
        )
        return fut


def episode(tok, turns: list[list[int]], honour_stops: bool = True):
    task = ToolArithmeticTask()
    prompt = FMT.ids(tok, task.prompt_text(ROW))
    engine = ScriptedIds(tok, turns, honour_stops)
    runner = EpisodeRunner(engine, ChatCalculatorEnv(), tok, prompt_format=FMT)
    try:
        comp = runner.submit(prompt, ROW, SamplingConfig(max_tokens=128), 0, "g0-s0").result(timeout=30)
    finally:
        runner.close()
    return prompt, engine, comp


def test_the_stop_string_is_a_text_stop_and_special_tokens_stay_token_stops(tok):
    stops = Stops(tok, ("</tool_call>", "<|im_end|>"))
    assert stops.strings == ("</tool_call>",) and stops.token_ids == (tok.eos_token_id,)
    with pytest.raises(ConfigError, match=r"env.stop.*special token"):
        Stops(tok, ("</tool_call><|im_end|>",))


def test_trained_ids_are_the_sampled_ids_plus_the_observation_ids(tok):
    """The model samples the call with ``}}`` as two tokens (``}``, ``}``), which re-tokenising
    its text would merge into one: the episode keeps the sampled ids, the next turn's context is
    exactly prompt + sampled + observation, and the trained sequence is that context plus the
    answer; only the model's ids are in the loss."""
    canonical = enc(tok, CALL)
    brace2 = enc(tok, "}}")[0]
    sampled_call = [t for c in canonical for t in ([enc(tok, "}")[0]] * 2 if c == brace2 else [c])]
    assert sampled_call != canonical and tok.decode(sampled_call) == CALL
    answer = enc(tok, answer_text(1081)) + [tok.eos_token_id]
    prompt, engine, comp = episode(tok, [sampled_call, answer])
    obs = enc(tok, FMT.observation(tok, "1081"))
    assert tok.decode(obs) == "<|im_end|>\n<|im_start|>tool\n1081<|im_end|>\n<|im_start|>assistant\n"
    assert engine.samplings[0].stop == ("</tool_call>",) and engine.samplings[0].stop_token_ids == ()
    assert engine.contexts == [prompt, prompt + sampled_call + obs]
    assert comp.token_ids == sampled_call + obs + answer
    assert comp.loss_mask == [1] * len(sampled_call) + [0] * len(obs) + [1] * len(answer)
    assert comp.logprobs == [-0.25] * len(sampled_call) + [0.0] * len(obs) + [-0.25] * len(answer)
    assert comp.reward == 1.0 and comp.finish_reason == "stop"
    assert comp.turns[0]["stop"] is True and comp.turns[0]["valid_call"] is True
    e = Experience(
        0, 0, 0, prompt, comp.token_ids, comp.logprobs, 1.0, 0, {}, 0.0, 1.0, False, loss_mask=comp.loss_mask
    )
    batch = collate([e], tok.pad_token_id)
    assert batch["input_ids"][0].tolist() == prompt + sampled_call + obs + answer
    trained = batch["loss_mask"][0].bool()
    assert batch["input_ids"][0, 1:][trained].tolist() == sampled_call + answer  # the final <|im_end|> too


def test_an_engine_that_runs_past_the_stop_string_is_cut_after_it(tok):
    """An engine that ignores the text stop (or a stop written across a resumed turn's
    boundary) writes on; the runner keeps the turn up to the token that completes
    ``</tool_call>``, as vLLM does, and the extra ids are neither trained nor in the context."""
    call = enc(tok, CALL)
    answer = enc(tok, answer_text(1081)) + [tok.eos_token_id]
    prompt, engine, comp = episode(tok, [call + enc(tok, " Then I add 5."), answer], honour_stops=False)
    obs = enc(tok, FMT.observation(tok, "1081"))
    assert engine.contexts[1] == prompt + call + obs
    assert comp.token_ids == call + obs + answer and comp.turns[0]["span"] == [0, len(call)]


def test_a_malformed_call_is_answered_as_the_tool_turn_and_counted(tok):
    bad = enc(tok, '<tool_call>{"name": "calculator", "arguments": {"expr": "23*47"}}</tool_call>')
    answer = enc(tok, "1081") + [tok.eos_token_id]
    prompt, engine, comp = episode(tok, [bad, answer])
    obs = enc(tok, FMT.observation(tok, "Error: calculator needs the argument 'expression'."))
    assert comp.token_ids == bad + obs + answer and comp.turns[0]["valid_call"] is False
    assert comp.reward == 1.0


def test_the_warm_start_trains_the_sequence_an_episode_builds(tok):
    """A demonstration (data/sft_data.py) is the episode of a model that samples the canonical
    ids: the same ids, the same tokens in the loss (model turns and the final EOS)."""
    task = ToolArithmeticTask()
    pieces = [(CALL, True), ("1081", False), (answer_text(1081), True)]
    ids, labels = demonstration_ids(tok, FMT, task.prompt_text(ROW), pieces)
    answer = enc(tok, answer_text(1081)) + [tok.eos_token_id]
    prompt, _, comp = episode(tok, [enc(tok, CALL), answer])
    assert ids + [tok.eos_token_id] == prompt + comp.token_ids
    assert [lab != -100 for lab in labels[len(prompt) :]] + [True] == [bool(m) for m in comp.loss_mask]


def rerender(tok, turns: list[str], prompt_text: str) -> list[int]:
    """The whole conversation rendered by the chat template and tokenised at once."""
    messages = [*FMT.messages(prompt_text), {"role": "assistant", "content": turns[0]}]
    messages += [{"role": "tool", "content": turns[1]}, {"role": "assistant", "content": turns[2]}]
    return enc(tok, tok.apply_chat_template(messages, tokenize=False))


def test_appended_ids_against_the_whole_conversation_rendered_by_the_template(tok):
    """docs/envs.md, "Appended context vs the chat template": with the canonical ids the two
    views are equal but for the newline the template writes after the final <|im_end|>; the
    <|im_end|> that closes the calling turn is in both at the same place, but it is the
    observation's (out of the loss), not the model's; ids the model sampled differently from
    the tokenizer (``}``, ``}``) stay as sampled and differ from the re-rendered ones."""
    prompt_text = ToolArithmeticTask().prompt_text(ROW)
    answer = enc(tok, answer_text(1081)) + [tok.eos_token_id]
    prompt, _, comp = episode(tok, [enc(tok, CALL), answer])
    full = rerender(tok, [CALL, "1081", answer_text(1081)], prompt_text)
    assert full[: len(prompt)] == prompt  # the system turn, the user turn, the assistant header
    assert full == prompt + comp.token_ids + enc(tok, "\n")  # only the template's final newline
    closing = len(prompt) + len(enc(tok, CALL))  # the <|im_end|> after </tool_call>
    assert full[closing] == tok.eos_token_id == comp.token_ids[closing - len(prompt)]
    assert comp.loss_mask[closing - len(prompt)] == 0  # the observation's token, never sampled
    brace = enc(tok, "}")[0]
    split = [t for c in enc(tok, CALL) for t in ([brace, brace] if tok.decode([c]) == "}}" else [c])]
    _, _, comp2 = episode(tok, [split, answer])
    appended = prompt + comp2.token_ids
    assert tok.decode(appended) == tok.decode(prompt + comp.token_ids)  # the same text
    assert appended != full[:-1] and len(appended) == len(full)  # other ids: one more, no newline


def test_a_last_token_that_runs_past_the_stop_string_stays_in_the_turn(tok):
    """``>.`` is one SmolLM2 token: a call that ends with it completes ``</tool_call>`` and
    writes one character more. The engine stops there and keeps it; so does the episode: the
    turn's text (what a re-rendered conversation must use) is ``...</tool_call>.``."""
    past = enc(tok, ">.")
    assert len(past) == 1
    call = enc(tok, CALL)[:-1] + past
    answer = enc(tok, answer_text(1081)) + [tok.eos_token_id]
    prompt, engine, comp = episode(tok, [call, answer])
    assert comp.token_ids[: len(call)] == call and comp.turns[0]["valid_call"] is True
    assert tok.decode(comp.token_ids[: len(call)]) == CALL + "."
    full = rerender(tok, [CALL + ".", "1081", answer_text(1081)], ToolArithmeticTask().prompt_text(ROW))
    assert full == prompt + comp.token_ids + enc(tok, "\n")
