"""Multi-turn episodes on the real engine: what is trained is what the engine sampled.

The trainer scores the whole trained sequence (prompt, model turns, observations) in one
forward; on every model token its logprob equals the engine's behaviour logprob, which holds
only if each turn's context on the engine was exactly the trained prefix (token in, token out:
nothing decoded and re-encoded). Observation tokens are masked and carry no behaviour logprob.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from data.envs.base import Environment, Step
from data.envs.episodes import EpisodeRunner
from data.rollout.controller import RolloutContext
from data.rollout.experience import collate
from data.rollout.prompts import PromptStream
from data.rollout.requests import Pending
from data.rollout.sync import SyncRollout
from modules.algo.advantages import GroupAdvantage
from modules.engine import SamplingConfig
from modules.policy.hf_policy import load_policy, named_weights, token_logprobs

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


def turn_tokens(engine, episode: str, turn: int) -> int:
    """Tokens generated so far by the engine request of model turn ``turn`` (0-based) of the
    episode with request id ``episode`` (ids ``<episode>-t<turn>[-r<k>]``, see ``EpisodeRunner``),
    0 before it is scheduled. vLLM's output processor collects every step's tokens, also for
    requests that return only their final output; the test reads that to order a sync inside a
    turn."""
    proc = engine._llm.output_processor
    for rid, internal in list(proc.external_req_ids.items()):
        if re.fullmatch(rf"{re.escape(episode)}-t{turn}(-r\d+)?", rid):
            for state in [proc.request_states.get(i) for i in list(internal)]:
                if state is not None:
                    return state.detokenizer.num_output_tokens()
    return 0


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


class SlowToolOnce(Environment):
    """Turn 1 calls a tool that takes ``tool_s`` seconds (``started`` is set when it begins);
    turn 2 ends the episode with reward 1."""

    def __init__(self, started, tool_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.started, self.tool_s = started, tool_s

    async def step(self, state, turn: str) -> Step:
        state["turns"] = state.get("turns", 0) + 1
        if state["turns"] > 1:
            return Step(reward=1.0, done=True)

        def tool() -> str:
            self.started.set()
            time.sleep(self.tool_s)
            return "ok"

        result = await self.tools.call(tool)
        return Step(observation=f"{result.output};", info={"valid_call": True, "tool_error": not result.ok})


def known_and_perturbed(engine, models):
    """The engine loaded with the tied model (version v0), that model, and a perturbed copy."""
    old, tok = load_policy(models["tied"])
    old.eval()
    engine.update_weights(named_weights(old), engine.version + 1)
    new, _ = load_policy(models["tied"])
    new.eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return old, new, tok, engine.version


def logprobs_of(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, torch.ones_like(ids), 1.0)
    return lp[0, len(prompt) - 1 :]


def test_a_weight_sync_during_a_tool_call_does_not_wait_and_the_next_turn_uses_the_new_weights(
    engine, models
):
    """Streaming (in-flight requests kept): the sync lands while the episode waits on a 2 s
    tool. It completes without waiting for the tool; turn 1 was written by version v0, turn 2
    by v0 + 1, and each turn's behaviour logprobs are those of the weights that wrote it."""
    old, new, tok, v0 = known_and_perturbed(engine, models)
    started = threading.Event()
    env = SlowToolOnce(started, 2.0, max_turns=2, max_turn_tokens=6, stop=("=",))
    runner = EpisodeRunner(engine, env, tok)
    prompt = tok("12*34?")["input_ids"]
    try:
        fut = runner.submit(prompt, {"id": 0}, SamplingConfig(max_tokens=30, ignore_eos=True), 3, "tool-sync")
        assert started.wait(timeout=60)
        t0 = time.monotonic()
        engine.update_weights(named_weights(new), v0 + 1, inflight="keep")
        sync_s = time.monotonic() - t0
        assert not fut.done()  # the tool is still running ...
        assert sync_s < 1.5, sync_s  # ... and the sync did not wait for it
        comp = fut.result(timeout=60)
    finally:
        runner.close()
        engine.update_weights(named_weights(old), engine.version + 1)  # the session engine's weights
    first, second = comp.turns
    assert first["versions"] == [v0] and second["versions"] == [v0 + 1] and comp.reward == 1.0
    got = torch.tensor(comp.logprobs)
    lp_old, lp_new = logprobs_of(old, prompt, comp.token_ids), logprobs_of(new, prompt, comp.token_ids)
    (a, b), (c, d) = first["span"], second["span"]
    assert (got[a:b] - lp_old[a:b]).abs().max() < 1e-4
    assert (got[c:d] - lp_new[c:d]).abs().max() < 1e-4
    assert (got[c:d] - lp_old[c:d]).abs().max() > 1e-3  # the two policies differ there


def test_partial_rollout_aborts_a_turn_at_a_sync_and_resumes_it_on_the_new_weights(engine, models):
    """Partial rollout (in-flight requests aborted): two 60-token turns with an observation
    between; the sync lands inside the second turn. The episode comes back unfinished, is
    resubmitted from its prefix and finishes: turn 1 holds v0, turn 2 both versions, and every
    model token's behaviour logprob is that of the weights that wrote it."""
    old, new, tok, v0 = known_and_perturbed(engine, models)
    runner = EpisodeRunner(engine, Answers(max_turns=2, max_turn_tokens=60), tok)
    sampling = SamplingConfig(max_tokens=200, ignore_eos=True)
    ctl = SyncRollout(1, 1, sampling)
    ctl.bind(RolloutContext(engine, Task(), tok, PromptStream([]), GroupAdvantage(), episodes=runner))
    prompt = tok("47*38?")["input_ids"]
    try:
        for _ in range(3):
            p = Pending({"id": 0}, 0, 0, 11, v0, prompt_ids=prompt)
            fut = ctl.submit(p)
            # the sync lands once turn 2 has a few tokens from v0: ordered by the engine's own
            # progress, not by a sleep (a timed sleep raced the episode on a busy machine)
            deadline = time.monotonic() + 120
            while turn_tokens(engine, "g0-s0", 1) < 4 and not fut.done():  # group 0, sample 0
                assert time.monotonic() < deadline, "turn 2 never started"
                time.sleep(0.001)
            engine.update_weights(named_weights(new), v0 + 1, inflight="abort")
            comp = fut.result(timeout=120)
            if comp.finish_reason != "stop":
                break
            # the thread was starved while the engine wrote the other 56 tokens: put the old
            # weights back and retry
            engine.update_weights(named_weights(old), v0 + 2)
            v0 = engine.version
        assert comp.finish_reason == "abort" and ctl.is_unfinished(comp, p)
        nxt = ctl.continuation(comp, p)
        e = ctl.to_experience(ctl.submit(nxt).result(timeout=120), nxt)
    finally:
        runner.close()
        engine.update_weights(named_weights(old), engine.version + 1)
    first, second = e.extras["turns"]
    split = len(nxt.prefix_ids)
    assert first["versions"] == [v0] and second["versions"] == [v0, v0 + 1], (first, second, split)
    assert second["span"][0] < split < second["span"][1] == len(e.response_ids)  # nothing after it
    assert sum(e.loss_mask) == 120 and e.token_versions()[split] == v0 + 1
    got = torch.tensor(e.behavior_logprobs)
    lp_old, lp_new = logprobs_of(old, prompt, e.response_ids), logprobs_of(new, prompt, e.response_ids)
    model = torch.tensor(e.loss_mask) > 0
    before, after = model.clone(), model.clone()
    before[split:], after[:split] = False, False
    assert (got[before] - lp_old[before]).abs().max() < 1e-4
    assert (got[after] - lp_new[after]).abs().max() < 1e-4
