"""Multi-turn episodes on the real engine: what is trained is what the engine sampled.

The trainer scores the whole trained sequence (prompt, model turns, observations) in one
forward; on every model token its logprob equals the engine's behaviour logprob, which holds
only if each turn's context on the engine was exactly the trained prefix (token in, token out:
nothing decoded and re-encoded). Observation tokens are masked and carry no behaviour logprob.
"""

from __future__ import annotations

import pytest
import torch

from data.envs.base import Environment, Step
from data.envs.episodes import EpisodeRunner
from data.rollout.controller import RolloutContext
from data.rollout.experience import collate
from data.rollout.prompts import PromptStream
from data.rollout.sync import SyncRollout
from modules.algo.advantages import GroupAdvantage
from modules.engine import SamplingConfig
from modules.policy.hf_policy import load_policy, token_logprobs

pytestmark = pytest.mark.engine


class Answers(Environment):
    """Every turn gets an observation; the episode ends after ``max_turns`` turns."""

    async def step(self, state, turn: str) -> Step:
        return Step(observation=f"{len(turn)};", reward=0.25)


class Task:
    def prompt_text(self, row: dict) -> str:
        return row["prompt"]

    def reward(self, row: dict, text: str) -> float:  # not used: the environment scores
        raise AssertionError("episodes are scored by their environment")


def test_trained_tokens_are_the_sampled_tokens_and_observations_are_masked(engine, models):
    model, tok = load_policy(models["tied"])
    model.eval()
    env = Answers(max_turns=3, max_turn_tokens=6, stop=("=",))
    runner = EpisodeRunner(engine, env, tok)
    ctl = SyncRollout(2, 2, SamplingConfig(max_tokens=40, ignore_eos=True))
    rows = [{"id": i, "prompt": p} for i, p in enumerate(["12*34?", "7*8?"])]
    ctl.bind(RolloutContext(engine, Task(), tok, PromptStream(rows), GroupAdvantage(), episodes=runner))
    try:
        batch = ctl.next_batch()
    finally:
        runner.close()
    assert len(batch) == 4
    equals = tok("=", add_special_tokens=False)["input_ids"][0]
    for e in batch:
        turns = e.extras["turns"]
        assert len(turns) == 3 and e.reward == pytest.approx(0.75)  # three steps of 0.25
        mask = e.loss_mask
        for t in turns:
            lo, hi = t["span"]
            assert all(mask[lo:hi]) and 1 <= hi - lo <= 6
            assert t["stop"] == (e.response_ids[hi - 1] == equals)
            o_lo, o_hi = t["observation"]
            assert not any(mask[o_lo:o_hi])
            turn = tok.decode(e.response_ids[lo:hi], skip_special_tokens=True)  # what step() read
            expected = tok(f"{len(turn)};", add_special_tokens=False)["input_ids"][: o_hi - o_lo]
            assert e.response_ids[o_lo:o_hi] == expected  # tokenised once, appended as is
        assert all(lp == 0.0 for lp, m in zip(e.behavior_logprobs, mask) if not m)
        t = collate([e], pad_id=tok.pad_token_id)
        with torch.no_grad():
            mine, _ = token_logprobs(model, t["input_ids"], t["attention_mask"], 1.0)
        on = t["loss_mask"][0] > 0
        diff = (mine[0][on] - t["behavior_logprobs"][0][on]).abs().max().item()
        assert diff < 1e-4, diff  # the engine saw exactly the trained prefix at every model token


def test_a_stop_token_ends_the_turn_and_stays_in_the_output(engine, models):
    model, tok = load_policy(models["tied"])
    prompt = tok("12*34?")["input_ids"]
    with torch.no_grad():
        first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())  # the greedy next token
    comp = engine.wait_result(
        engine.submit(prompt, SamplingConfig(temperature=0.0, max_tokens=8, stop_token_ids=(first,)), seed=0),
        timeout=60,
    )
    assert comp.token_ids == [first] and comp.finish_reason == "stop"
