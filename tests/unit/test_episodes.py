"""Multi-turn episodes (``data/envs``): token in, token out; observations masked; tools that
fail or hang become observations; budgets; a turn cut by a weight sync resumes where it was.

A scripted real-time engine stands in for vLLM (the real engine: tests/integration); it
writes the turns of ``SCRIPT`` one after another, stopping at a stop token as vLLM does."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from dataclasses import replace

import pytest

from data.envs.base import Environment, SingleTurn, Step
from data.envs.episodes import EpisodeRunner
from data.envs.tools import Fixed, LogNormal, ToolRunner
from data.rollout.controller import RolloutContext
from data.rollout.experience import collate
from data.rollout.prompts import PromptStream
from data.rollout.sync import SyncRollout
from modules.algo.advantages import GroupAdvantage
from modules.engine import SamplingConfig
from modules.engine.sim import CharTokenizer
from modules.engine.types import Completion

TOK = CharTokenizer()
EOS = TOK.eos_token_id


class ScriptedEngine:
    """Answers each request with the next turn of its script that the context has not yet
    reached: turn k is written after k observations. ``cut_at``: the request number to abort
    after that many tokens (a weight sync under partial rollout)."""

    concurrency = None

    def __init__(self, turns: list[str], cut: tuple[int, int] | None = None) -> None:
        self.turns = [[ord(c) for c in t] for t in turns]
        self.version = 0
        self.contexts: list[list[int]] = []
        self.cut = cut
        self.lock = threading.Lock()

    def submit(self, prompt_ids, sampling: SamplingConfig, seed=None, request_id=None, prompt_logprobs=False):
        with self.lock:
            n = len(self.contexts)
            self.contexts.append(list(prompt_ids))
        done_turns = sum(1 for t in prompt_ids if t == ord("\n"))  # observations end with a newline
        script = self.turns[min(done_turns, len(self.turns) - 1)]
        written = self._written(prompt_ids, script)
        out = []
        for t in script[written:]:
            out.append(t)
            if t in sampling.stop_token_ids or t == EOS or len(out) >= sampling.max_tokens:
                break
        reason = "stop" if out and (out[-1] in sampling.stop_token_ids or out[-1] == EOS) else "length"
        if self.cut is not None and n == self.cut[0]:
            out, reason = out[: self.cut[1]], "abort"
            self.version += 1  # the sync that cut it
        fut: cf.Future = cf.Future()
        comp = Completion(
            request_id or "r",
            list(prompt_ids),
            out,
            [-0.5] * len(out),
            reason,
            0.0,
            1.0,
            [(self.version, 0, len(out))],
        )
        fut.set_result(comp)
        return fut

    @staticmethod
    def _written(context: list[int], script: list[int]) -> int:
        """How much of this turn the context already holds (a resumed turn)."""
        for k in range(len(script), 0, -1):
            if context[-k:] == script[:k]:
                return k
        return 0

    def wait_any(self, pending):
        done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED, timeout=10)
        assert done, "no episode finished in 10 s"
        return done


class Calc(Environment):
    """Turns ending with '=' are tool calls (the product); any other turn is the answer."""

    def __init__(self, tool=None, **kw) -> None:
        super().__init__(stop=("=",), **kw)
        self.tool = tool or (lambda expr: eval(expr, {"__builtins__": {}}))

    async def step(self, state, turn: str) -> Step:
        if turn.endswith("="):
            result = await self.tools.call(self.tool, turn.rsplit(";", 1)[-1][:-1])
            text = str(result.output) if result.ok else result.output
            return Step(observation=text + "\n", info={"tool_error": not result.ok})
        right = turn.strip().rstrip(".") == str(state["row"]["a"] * state["row"]["b"])
        return Step(reward=float(right), done=True)


ROW = {"id": 0, "a": 13, "b": 17}
PROMPT = [ord(c) for c in "13*17?"]
SAMPLING = SamplingConfig(max_tokens=64)


def run(runner: EpisodeRunner, **kw) -> Completion:
    return runner.submit(PROMPT, ROW, kw.pop("sampling", SAMPLING), 0, "g0-s0", **kw).result(timeout=10)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_an_episode_is_the_sampled_tokens_and_the_observations_once_each_masked():
    engine = ScriptedEngine(["13*17=", "221.\x01"])
    runner = EpisodeRunner(engine, Calc(), TOK)
    comp = run(runner)
    assert comp.token_ids == ids("13*17=") + ids("221\n") + ids("221.") + [EOS]
    assert comp.loss_mask == [1] * 6 + [0] * 4 + [1] * 5
    assert comp.logprobs == [-0.5] * 6 + [0.0] * 4 + [-0.5] * 5  # no behaviour logprob for observations
    # each turn's context is the previous context plus exactly those ids: nothing re-tokenised
    assert engine.contexts == [PROMPT, PROMPT + comp.token_ids[:10]]
    assert comp.reward == 1.0 and comp.finish_reason == "stop"
    assert [t["span"] for t in comp.turns] == [[0, 6], [10, 15]]
    assert [t["observation"] for t in comp.turns] == [[6, 10], [0, 0]]
    runner.close()


def test_observation_tokens_are_out_of_the_loss_in_the_trained_batch():
    engine = ScriptedEngine(["13*17=", "220.\x01"])
    runner = EpisodeRunner(engine, Calc(), TOK)
    ctl = SyncRollout(1, 2, SAMPLING)
    task = SingleTurnTask()
    ctl.bind(RolloutContext(engine, task, TOK, PromptStream([ROW]), GroupAdvantage(), episodes=runner))
    batch = ctl.next_batch()
    assert len(batch) == 2 and all(e.reward == 0.0 for e in batch)  # 220 is wrong
    e = batch[0]
    assert e.response_ids == ids("13*17=") + ids("221\n") + ids("220.") + [EOS]
    assert e.loss_mask == [1] * 6 + [0] * 4 + [1] * 5
    assert e.extras["turns"][0]["span"] == [0, 6]
    t = collate([e], pad_id=0)
    lo = len(e.prompt_ids) - 1  # target index of the first response token
    assert t["loss_mask"][0, lo : lo + 15].tolist() == [1.0] * 6 + [0.0] * 4 + [1.0] * 5
    runner.close()


class SingleTurnTask:
    def prompt_text(self, row: dict) -> str:
        return f"{row['a']}*{row['b']}?"

    def reward(self, row: dict, text: str) -> float:
        return float(text.strip().rstrip(".") == str(row["a"] * row["b"]))


def test_a_task_as_a_one_turn_environment_scores_like_the_task():
    engine = ScriptedEngine(["221.\x01"])
    comp = run(EpisodeRunner(engine, SingleTurn(SingleTurnTask()), TOK))
    assert comp.token_ids == ids("221.") + [EOS] and comp.loss_mask == [1] * 5 and comp.reward == 1.0


def boom(expr: str) -> int:
    raise ZeroDivisionError("division by zero")


def hang(expr: str) -> int:
    time.sleep(3)
    return 0


@pytest.mark.parametrize(
    ("tool", "says"), [(boom, "tool error: ZeroDivisionError"), (hang, "tool timed out")]
)
def test_a_tool_that_raises_or_hangs_is_an_observation_and_a_count(tool, says):
    engine = ScriptedEngine(["13*17=", "221.\x01"])
    tools = ToolRunner(timeout_s=0.2, retries=1)
    runner = EpisodeRunner(engine, Calc(tool=tool, tools=tools), TOK)
    t0 = time.monotonic()
    comp = run(runner)
    assert time.monotonic() - t0 < 2.0  # two attempts of 0.2 s, no hang
    obs = "".join(chr(c) for c, m in zip(comp.token_ids, comp.loss_mask) if m == 0)
    assert obs.startswith(says), obs
    assert comp.turns[0]["tool_error"] is True and comp.reward == 1.0  # the episode went on
    stats = tools.take_stats()
    assert stats["env/tool_calls"] == 1 and stats["env/tool_errors"] == 1
    assert stats["env/tool_timeouts"] == float(tool is hang)
    runner.close()


def test_max_turns_and_the_token_budget_end_an_episode():
    engine = ScriptedEngine(["1*1=", "2*2=", "3*3=", "4*4="])
    comp = run(EpisodeRunner(engine, Calc(max_turns=2), TOK))
    assert len(comp.turns) == 2 and comp.finish_reason == "stop" and comp.reward == 0.0
    # the last turn's call is answered (its step runs) but no observation follows it
    assert comp.token_ids == ids("1*1=1\n2*2=") and comp.turns[-1]["observation"] == [0, 0]
    comp = run(EpisodeRunner(engine, Calc(max_total_tokens=7), TOK))
    assert len(comp.token_ids) == 7 and comp.finish_reason == "length"
    assert comp.loss_mask == [1] * 4 + [0] * 2 + [1]  # "1*1=" "1\n" then one token of the next turn


def test_a_turn_cut_by_a_weight_sync_resumes_where_it_was():
    """Partial rollout: the second turn's request is aborted after 2 tokens; the controller
    resubmits the episode as prefix + state; the finished experience holds every token once,
    its mask and its two versions."""
    engine = ScriptedEngine(["13*17=", "221.\x01"], cut=(1, 2))
    runner = EpisodeRunner(engine, Calc(), TOK)
    ctl = SyncRollout(1, 1, SAMPLING)
    ctl.bind(
        RolloutContext(engine, SingleTurnTask(), TOK, PromptStream([ROW]), GroupAdvantage(), episodes=runner)
    )
    p = ctl.plan_group(ROW)[0]
    comp = ctl.submit(p).result(timeout=10)
    assert comp.finish_reason == "abort" and comp.token_ids == ids("13*17=221\n22")
    assert ctl.is_unfinished(comp, p)
    nxt = ctl.continuation(comp, p)
    final = ctl.submit(nxt).result(timeout=10)
    assert engine.contexts[-1] == PROMPT + ids("13*17=221\n22")  # the turn goes on from its prefix
    e = ctl.to_experience(final, nxt)
    assert e.response_ids == ids("13*17=221\n221.") + [EOS]
    assert e.loss_mask == [1] * 6 + [0] * 4 + [1] * 5 and e.reward == 1.0
    assert e.token_versions()[:6] == [0] * 6 and e.token_versions()[-3:] == [1] * 3
    runner.close()


def test_a_stop_of_two_tokens_ends_the_turn_as_text_and_the_engine_is_asked_for_it():
    """``==`` is two tokens: it goes to the engine as a text stop (vLLM matches it on its text);
    this scripted engine ignores text stops, so the runner cuts the turn after the token that
    completes it, as vLLM does, and the turn counts as ended by its stop."""
    engine = ScriptedEngine(["13*17==x", "221.\x01"])
    seen = []
    submit = engine.submit
    engine.submit = lambda prompt, sampling, **kw: seen.append(sampling) or submit(prompt, sampling, **kw)
    runner = EpisodeRunner(engine, replace_stop(Calc(), ("==",)), TOK)
    comp = run(runner)
    assert seen[0].stop == ("==",) and seen[0].stop_token_ids == ()
    assert comp.token_ids[:7] == ids("13*17==") and comp.turns[0]["stop"] is True
    assert comp.turns[0]["span"] == [0, 7] and comp.loss_mask[:7] == [1] * 7
    runner.close()


def test_a_stop_the_tokenizer_cannot_produce_is_refused():
    with pytest.raises(ValueError, match="env.stop"):
        EpisodeRunner(ScriptedEngine(["x"]), replace_stop(Calc(), ("\x00=",)), TOK)


def replace_stop(env: Environment, stop: tuple[str, ...]) -> Environment:
    env.stop = stop
    return env


def test_latency_models_are_bounded_and_seeded():
    import random

    rng = random.Random(0)
    tail = [LogNormal(median_s=0.1, sigma=1.0, cap_s=2.0).sample(rng) for _ in range(2000)]
    assert max(tail) <= 2.0 and 0.08 < sorted(tail)[1000] < 0.12  # the median
    assert sorted(tail)[1980] > 0.6  # a heavy tail: p99 about 10x the median
    assert Fixed(0.25).sample(rng) == 0.25
    with pytest.raises(Exception, match="env.tools.latency.sigma"):
        LogNormal(sigma=-1)


def test_modelled_latency_delays_the_call_and_concurrency_limits_it():
    import asyncio

    tools = ToolRunner(concurrency=2, latency=Fixed(0.1))

    async def four() -> float:
        t0 = time.monotonic()
        await asyncio.gather(*(tools.call(lambda: 1) for _ in range(4)))
        return time.monotonic() - t0

    elapsed = asyncio.run(four())
    assert 0.18 < elapsed < 1.0  # two waves of 0.1 s
    assert replace(SAMPLING, stop_token_ids=(61,)).as_dict()["stop_token_ids"] == [61]


def test_a_turn_cut_by_the_per_turn_cap_is_answered_like_any_other():
    engine = ScriptedEngine(["13*17=", "221.\x01"])
    comp = run(EpisodeRunner(engine, Calc(max_turn_tokens=3), TOK))
    assert comp.token_ids == ids("13*") and comp.reward == 0.0  # the environment took it as the answer
    assert comp.finish_reason == "stop" and len(comp.turns) == 1
    comp = run(EpisodeRunner(engine, Calc(max_turn_tokens=6), TOK))
    assert comp.token_ids == ids("13*17=221\n221.") + [EOS] and comp.reward == 1.0


def test_observations_count_for_neither_staleness_nor_carry_over():
    """Observation tokens are in no version span: the oldest version that wrote a token is the
    first model turn's (here 3, though the episode was planned at 2), and one version across
    the episode is not 'carried over'."""
    from data.rollout.batches import rollout_stats
    from data.rollout.experience import Experience

    e = Experience(0, 0, 0, [5], [7] * 9, [-0.5] * 9, 0.0, 2, {}, 0.0, 1.0, False)
    e.version_spans, e.loss_mask = [(3, 0, 4), (3, 6, 9)], [1] * 4 + [0] * 2 + [1] * 3
    assert e.oldest_version() == 3 and min(e.token_versions()) == 2  # the gap took the start version
    assert rollout_stats([e])["rollout/carried_frac"] == 0.0
    e.version_spans = [(3, 0, 4), (4, 6, 9)]
    assert rollout_stats([e])["rollout/carried_frac"] == 1.0


class BrokenReset(Calc):
    async def reset(self, row):
        raise KeyError("answer")


def test_an_environment_that_fails_to_reset_scores_the_episode_zero():
    # under data.reward_errors=zero; the default (fail) stops the run: test_episode_faults.py
    runner = EpisodeRunner(ScriptedEngine(["221.\x01"]), BrokenReset(), TOK, "zero")
    comp = run(runner)
    assert (
        comp.reward == 0.0
        and comp.token_ids == []
        and "reset on prompt id 0: KeyError" in comp.turns[0]["env_error"]
    )
    assert runner.take_stats()["env/env_errors_reset"] == 1


def test_a_coroutine_tool_behind_a_partial_is_awaited():
    import asyncio
    import functools

    async def add(a: int, b: int) -> int:
        await asyncio.sleep(0)
        return a + b

    result = asyncio.run(ToolRunner().call(functools.partial(add, 2), 3))
    assert result.ok and result.output == 5


def test_turn_stats_count_calls_their_validity_and_tool_errors():
    """Turns and tool calls per episode; validity over call attempts; tool errors over the
    well-formed calls only (a malformed call never reached the tool)."""
    from data.envs.base import turn_stats

    episodes = [
        [{"valid_call": True, "tool_error": False}, {"reward": 1.0}],  # call, answer
        [{"valid_call": False, "tool_error": False}, {"valid_call": True, "tool_error": True}, {}],
        [{"reward": 0.0}],  # answered at once
    ]
    stats = turn_stats(episodes)
    assert stats == {
        "turns": 6 / 3,
        "tool_calls": 3 / 3,
        "valid_call_rate": 2 / 3,
        "tool_error_rate": 1 / 2,
    }
    assert turn_stats([[{}], [{}, {}]]) == {"turns": 1.5, "tool_calls": 0.0}  # no rates without calls
    assert turn_stats([]) == {}


def test_the_documented_environment_example_runs():
    """docs/envs.md's "Writing an environment" class, as printed, plays an episode."""
    import asyncio
    import re

    from tests.conftest import ROOT

    text = (ROOT / "docs" / "envs.md").read_text()
    code = re.search(r"## Writing an environment.*?```python\n(.*?)```", text, re.S)[1]
    assert len(code.splitlines()) < 40
    namespace: dict = {}
    exec(compile(code, "docs/envs.md", "exec"), namespace)
    env = namespace["Guess"](max_turns=4, stop=(";",))

    async def play() -> list:
        state = await env.reset({"id": 3})
        low, high, steps = 1, 9, []
        while True:
            guess = (low + high) // 2
            step = await env.step(state, f"{guess};")
            steps.append(step)
            if step.done:
                return steps
            low, high = (guess + 1, high) if step.observation == "higher;" else (low, guess - 1)

    steps = asyncio.run(play())
    assert steps[-1].reward == 1.0 and len(steps) <= 4
    assert asyncio.run(env.step({"secret": 5}, "x;")).observation == "a digit;"
