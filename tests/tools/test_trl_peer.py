"""The TRL peer benchmark's pieces that run without TRL: which settings it can mirror, and the
run directory it writes (read by ``tools.heldout_curve`` and ``lab.modes``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from tests.conftest import compose
from tools.trl_peer import check_matchable, write_run


def test_the_sync_and_real_model_recipes_are_mirrored_and_other_settings_are_refused_by_field():
    check_matchable(compose(["recipe=sync_grpo"]))
    # 2 optimizer steps per rollout batch, the decoupled anchor, tis, bf16 autocast: TRL's
    # steps_per_generation, its trainer-side old logprobs, no sampler to correct, bf16=True
    check_matchable(compose(["recipe=smollm2_grpo"]))
    for override, field in [
        ("algo.minibatches=3", "algo.minibatches"),  # 128 samples do not split in 3
        ("algo.epochs=2", "algo.epochs"),
        ("algo.loss.aggregation=seq_mean_token_mean", "algo.loss.aggregation"),
        ("algo/correction=tseq_is", "algo/correction"),
        ("algo/objective=cispo", "algo/objective"),
        ("rollout/group_filter=informative", "rollout.group_filter"),
        ("trainer.precision=16-mixed", "trainer.precision"),
    ]:
        with pytest.raises(SystemExit, match=field):
            check_matchable(compose(["recipe=sync_grpo", override]))


def test_trl_tokenises_the_chat_prompt_to_the_ids_the_project_trains_on():
    from pathlib import Path

    from transformers import AutoTokenizer

    from modules.policy.prompt_format import ChatTemplate, PlainText
    from tools.trl_peer import check_prompt_ids, trl_prompt

    path = Path(__file__).resolve().parents[2] / "artifacts" / "smollm2-135m-instruct"
    assert (path / "tokenizer.json").is_file(), f"{path} is missing: run `make smollm2`"
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["Mia has 6 apples and finds 7 more. How many apples does Mia have now?"]
    check_prompt_ids(ChatTemplate(), tok, texts)  # TRL's apply_chat_template == ours
    check_prompt_ids(ChatTemplate(system="Be brief."), tok, texts)
    assert trl_prompt(ChatTemplate(), texts[0]) == [{"role": "user", "content": texts[0]}]
    assert trl_prompt(PlainText(), texts[0]) == texts[0]

    class AddsBos(ChatTemplate):  # a format whose ids differ from TRL's tokenisation
        def ids(self, tokenizer, text):
            return [tokenizer.bos_token_id or 0, *super().ids(tokenizer, text)]

    with pytest.raises(SystemExit, match="model.prompt_format"):
        check_prompt_ids(AddsBos(), tok, texts)


def test_the_run_directory_reads_like_a_train_py_run(tmp_path):
    from lab.modes_run import last, read_metrics
    from tools.heldout_curve import run_overrides, training_time_of, wall_at_steps

    rows = [
        {
            "step": s,
            "perf/wall_s": 1.5 * (s + 1),
            "perf/samples_total": 128 * (s + 1),
            "train/reward_mean": 0.5,
        }
        for s in range(3)
    ]
    write_run(tmp_path, ["recipe=sync_grpo", "seed=1"], rows)
    assert run_overrides(tmp_path) == ["recipe=sync_grpo", "seed=1"]
    logged = wall_at_steps(tmp_path)
    assert training_time_of(3, logged) == {"wall_s": 4.5, "samples": 384.0}  # after 3 steps
    metrics = read_metrics(tmp_path)
    assert last(metrics, "rollout/staleness_max") == 0.0  # TRL has no staleness
    assert math.isnan(last(metrics, "perf/engine_idle_frac"))  # nor an engine


def drive(processors, input_ids, new, vocab):
    """``generate``'s sampling loop over scripted tokens: at each step the logits processors see
    the context so far and logits that give the scripted token probability 1 (log 0)."""
    import torch

    rows = torch.arange(new.shape[0])
    for k in range(new.shape[1]):
        logits = torch.full((new.shape[0], vocab), -1e9)
        logits[rows, new[:, k]] = 0.0
        processors(torch.cat([input_ids, new[:, :k]], dim=1), logits)
    return SimpleNamespace(sequences=torch.cat([input_ids, new], dim=1))


class ScriptedModel:
    """``generate`` as Hugging Face runs it (left-padded input, the logits processors called at
    each step, ``sequences`` returned), writing by rule: after the question "c=", after an
    observation "a." + EOS; one row (the question "9*9?") writes "a" then filler past the
    episode's budget."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kw):
        import torch

        vocab = len(self.tok)
        rows = []
        for ids, m in zip(input_ids.tolist(), attention_mask.tolist()):
            text = self.tok.decode([t for t, k in zip(ids, m) if k], skip_special_tokens=True)
            if text.startswith("9*9?"):
                new = self.tok("a" + "1" * 60, add_special_tokens=False)["input_ids"]
            elif text.endswith("?"):
                new = self.tok("c=xx", add_special_tokens=False)["input_ids"]  # stops at "="
            else:
                new = [*self.tok("a.", add_special_tokens=False)["input_ids"], self.tok.eos_token_id]
            new = new[:max_new_tokens]
            rows.append(new + [pad_token_id] * (max_new_tokens - len(new)))
        return drive(kw["logits_processor"], input_ids, torch.tensor(rows), vocab)


def test_trl_episodes_follow_the_projects_episode_rules(models):
    """The TRL peer's multi-turn rollout (tools/trl_episodes.py) on the calculator: model and
    observation tokens in order, the observation masked out with logprob 0, the environment's
    reward, and the token budget cutting a turn that runs past it."""
    from transformers import AutoTokenizer

    from data.envs.calculator_env import CalculatorEnv
    from data.tasks.calculator import CalculatorTask
    from tools.trl_episodes import EpisodeRollout

    tok = AutoTokenizer.from_pretrained(models["tied"])
    task = CalculatorTask()
    rows = [{"prompt": "47*38?", "answer": "1786"}, {"prompt": "9*9?", "answer": "81"}]
    rollout = EpisodeRollout(
        CalculatorEnv(max_turns=3),
        task,
        {task.prompt_text(r): r for r in rows},
        tok,
        SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=24),
    )
    out = rollout.episodes([task.prompt_text(r) for r in rows], ScriptedModel(tok))
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert out["prompt_ids"][0] == tok(task.prompt_text(rows[0]))["input_ids"]
    assert out["completion_ids"][0] == [*enc("c="), *enc("1786;"), *enc("a."), tok.eos_token_id]
    assert out["env_mask"][0] == [1, 1, 0, 0, 0, 0, 0, 1, 1, 1]
    assert [lp == 0.0 for lp in out["logprobs"][0]] == [True] * 10  # probability 1 (scripted), obs 0
    assert out["episode_reward"] == [1.0, 0.0]
    assert len(out["completion_ids"][1]) == 24 and out["env_mask"][1] == [1] * 24  # cut by the budget
    assert rollout.turn_stats[0][0]["valid_call"] is True and rollout.turn_stats[0][1]["done"] is True
    rollout.close()  # the environment's tool runner and the rollout's loop
    assert rollout.loop.is_closed()
    assert rollout.response_len_mean == (10 + 24) / 2  # every episode token, as the project counts


def test_trl_episodes_truncate_and_cap_turns_as_the_episode_runner(models):
    """``truncated`` (given to ``env.final_reward``) is the runner's ``finish_reason == "length"``:
    not for an answer that ends with EOS exactly at the budget, yes for a turn the budget cuts;
    ``env.max_turn_tokens`` caps each model turn (a capped turn is answered like any other)."""
    from transformers import AutoTokenizer

    from data.envs.calculator_env import CalculatorEnv
    from data.tasks.calculator import CalculatorTask
    from tools.trl_episodes import EpisodeRollout

    class Env(CalculatorEnv):
        def final_reward(self, state, rewards, truncated):
            return float(truncated)

    tok = AutoTokenizer.from_pretrained(models["tied"])
    task = CalculatorTask()
    rows = [{"prompt": "47*38?", "answer": "1786"}, {"prompt": "9*9?", "answer": "81"}]
    texts = {task.prompt_text(r): r for r in rows}
    prompts = [task.prompt_text(r) for r in rows]

    def rollout(budget, **env):
        sampling = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=budget)
        return EpisodeRollout(Env(**env), task, texts, tok, sampling).episodes(prompts, ScriptedModel(tok))

    out = rollout(10, max_turns=3)  # "c=" "1786;" "a." EOS: 10 tokens, the last one EOS
    assert len(out["completion_ids"][0]) == 10 and out["episode_reward"] == [0.0, 1.0]
    out = rollout(9, max_turns=3)  # the answer's turn cut before its EOS
    assert len(out["completion_ids"][0]) == 9 and out["episode_reward"] == [1.0, 1.0]
    out = rollout(24, max_turns=1, max_turn_tokens=5)  # one turn of at most 5 tokens, then scored
    assert [len(c) for c in out["completion_ids"]] == [2, 5] and out["episode_reward"] == [0.0, 0.0]


class ScriptedChatModel:
    """``generate`` as Hugging Face returns it, writing SmolLM2-style turns by rule: before any
    tool turn a call of the question's product and, past it, text a model with ``stop_strings``
    would not have written (the rollout must cut the turn after ``</tool_call>``); after a tool
    turn the answer, then ``<|im_end|>``, then padding (pad == EOS in SmolLM2)."""

    def __init__(self, tokenizer, call: str, answer: str) -> None:
        self.tok, self.call, self.answer = tokenizer, call, answer
        self.kwargs: dict = {}

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kw):
        import torch

        self.kwargs = kw
        enc = lambda s: self.tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
        rows = []
        for ids, m in zip(input_ids.tolist(), attention_mask.tolist()):
            context = self.tok.decode([t for t, k in zip(ids, m) if k])
            if "<|im_start|>tool" in context:
                new = [*enc(self.answer), self.tok.eos_token_id]
            else:
                new = enc(self.call + " Then I will answer")
            new = new[:max_new_tokens]
            rows.append(new + [pad_token_id] * (max_new_tokens - len(new)))
        return drive(kw["logits_processor"], input_ids, torch.tensor(rows), len(self.tok))


def test_trl_episodes_on_the_chat_template_with_a_text_stop():
    """``recipe=smollm2_tools`` through TRL's rollout hook, with SmolLM2's tokenizer: the prompt
    is the chat template's (the ids the project trains on), the call's turn ends after the token
    that completes the five-token ``</tool_call>`` (Hugging Face's ``stop_strings`` asked for it),
    the observation is the template's tool turn (the ``<|im_end|>`` closing the call's turn first,
    then the next assistant header), masked out; the whole episode decodes to what the template
    renders for the same conversation."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from data.envs.chat_tools import ChatCalculatorEnv
    from data.envs.tools import ToolRunner
    from data.tasks.tool_arithmetic import ToolArithmeticTask, answer_text, call_text
    from modules.policy.prompt_format import ChatTemplate
    from tools.trl_episodes import EpisodeRollout

    path = Path(__file__).resolve().parents[2] / "artifacts" / "smollm2-135m-instruct"
    assert (path / "tokenizer.json").is_file(), f"{path} is missing: run `make smollm2`"
    tok = AutoTokenizer.from_pretrained(path)
    task = ToolArithmeticTask()
    row = task.build("train", 1)[0]
    fmt = ChatTemplate()
    text = task.prompt_text(row)
    env = ChatCalculatorEnv(tools=ToolRunner(concurrency=2, timeout_s=5.0), stop=["</tool_call>"])
    sampling = SimpleNamespace(temperature=0.7, top_p=1.0, top_k=-1, max_tokens=128)
    rollout = EpisodeRollout(env, task, {text: row}, tok, sampling, fmt)
    call, answer = call_text(row["expression"]), answer_text(row["answer"])
    model = ScriptedChatModel(tok, call, answer)
    out = rollout.episodes([text], model)
    rollout.close()
    assert model.kwargs["stop_strings"] == ["</tool_call>"] and model.kwargs["tokenizer"] is tok
    # generate adds no warper of its own (top_k=None would be Hugging Face's 50); the rollout's
    # Sampler applies T = 0.7 (top-k, top-p off) and records what each token was drawn from
    assert (model.kwargs["top_k"], model.kwargs["top_p"], model.kwargs["temperature"]) == (0, 1.0, 1.0)
    (sampler,) = model.kwargs["logits_processor"]
    assert [(type(w).__name__, getattr(w, "temperature", None)) for w in sampler.warpers] == [
        ("TemperatureLogitsWarper", 0.7)
    ]
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    obs = enc(fmt.observation(tok, str(row["answer"])))
    assert tok.decode(obs).startswith("<|im_end|>\n<|im_start|>tool\n")
    assert tok.decode(obs).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert out["prompt_ids"] == [fmt.ids(tok, text)]
    (ids,), (mask,) = out["completion_ids"], out["env_mask"]
    n_call = len(enc(call))
    assert tok.decode(ids[:n_call]) == call and ids[n_call : n_call + len(obs)] == obs
    assert ids[n_call + len(obs) :] == [*enc(answer), tok.eos_token_id]  # the EOS stays (pad == EOS)
    assert mask == [1] * n_call + [0] * len(obs) + [1] * (len(enc(answer)) + 1)
    assert out["episode_reward"] == [1.0] and rollout.turn_stats[0][0]["valid_call"] is True
    conversation = [
        *fmt.messages(text),
        {"role": "assistant", "content": call},
        {"role": "tool", "content": str(row["answer"])},
        {"role": "assistant", "content": answer},
    ]
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(out["prompt_ids"][0] + ids) + "\n" == rendered  # the template ends a turn with "\n"


def test_the_sampler_records_the_distribution_generate_draws_from(models):
    """``Sampler`` (temperature, top-k, top-p, each sampled token's log-probability kept as it is
    drawn) against ``generate``'s own warpers and ``output_scores``: the same draws under the
    same seed, the same log-probabilities, without keeping every step's distribution."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from tools.trl_episodes import Sampler

    model = AutoModelForCausalLM.from_pretrained(models["tied"]).eval()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    common = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=12)
    common |= dict(pad_token_id=0, eos_token_id=[], return_dict_in_generate=True)
    for temperature, top_k, top_p in [(0.7, 0, 0.9), (1.3, 5, 1.0), (1.0, 0, 1.0)]:
        torch.manual_seed(0)
        ref = model.generate(**common, temperature=temperature, top_k=top_k, top_p=top_p, output_scores=True)
        want = torch.stack(ref.scores, 1).log_softmax(-1).gather(-1, ref.sequences[:, 4:, None]).squeeze(-1)
        sampler = Sampler(temperature, top_k, top_p)
        torch.manual_seed(0)
        out = model.generate(
            **common, temperature=1.0, top_k=0, top_p=1.0, logits_processor=LogitsProcessorList([sampler])
        )
        assert torch.equal(out.sequences, ref.sequences)
        got = sampler.logprobs(out.sequences)
        assert got.shape == (2, 12) and torch.allclose(got, want, atol=1e-5)
        assert (got < -1e-3).any()  # a real distribution, not probability 1 everywhere


def test_a_rollout_batch_is_trained_in_micro_batches_as_the_project_does():
    """``algo.micro_batch_size`` through TRL's gradient accumulation: the tool recipe's 64 samples
    in one optimizer step of 4 x 16; the single-turn recipe's two steps of 16 each."""
    from tools.trl_peer import batch_shape

    assert batch_shape(compose(["recipe=smollm2_tools"])) == (16, 4, 4)
    assert batch_shape(compose(["recipe=smollm2_grpo"])) == (16, 1, 2)  # 8 x 4, 2 minibatches of 16
    assert batch_shape(compose(["recipe=smollm2_tools", "algo.micro_batch_size=24"])) == (16, 4, 4)
    assert batch_shape(compose(["recipe=smollm2_tools", "algo.micro_batch_size=null"])) == (64, 1, 1)
    assert batch_shape(compose(["recipe=smollm2_tools", "algo.minibatches=2"])) == (16, 2, 4)


def test_both_clocks_read_at_the_end_of_a_step(tmp_path):
    """``train.py`` logs ``perf/wall_s`` after a step's forward pass; the weights a checkpoint
    holds exist once its backward, optimizer step and overhead are done (the TRL peer logs
    then): the curve's clock, the run's training seconds and a stored record's retiming add them."""
    import csv

    from lab.modes_run import end_of_training, retime
    from tools.heldout_curve import training_time_of, wall_at_steps

    cols = ["step", "perf/wall_s", "perf/samples_total", "perf/step_backward_s"]
    cols += ["perf/step_optimizer_s", "perf/step_overhead_s"]
    with open(tmp_path / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerow([0, 10.0, 64, 20.0, 1.0, 0.5])
        w.writerow([1, 40.0, 128, 21.0, 1.0, 0.5])
    logged = wall_at_steps(tmp_path)
    assert training_time_of(1, logged) == {"wall_s": 31.5, "samples": 64.0}  # 10 + 20 + 1 + 0.5
    assert end_of_training(tmp_path) == 62.5
    record = {
        "seed": 0,
        "train_wall_s": 40.0,
        "curve": [{"step": 0, "train_wall_s": 0.0}, {"step": 2, "train_wall_s": 40.0}],
    }
    again = retime(record, tmp_path)
    assert [p["train_wall_s"] for p in again["curve"]] == [0.0, 62.5] and again["train_wall_s"] == 62.5
