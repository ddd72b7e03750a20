"""The agent path under faults (docs/envs.md, "Faults and the episode lifecycle"): an
environment that raises, blocks or exits is one named error or a counted zero, never a silent
zero, a dead loop or a stall; every episode is cleaned up however it ends; seeds are distinct."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time

import pytest

from data.envs.base import Step, check_episodes_fit, episode_fits_engine
from data.envs.env_calls import EnvironmentFault
from data.envs.episodes import EpisodeRunner
from modules.config.errors import ConfigError
from modules.engine.types import Completion
from tests.unit.test_episodes import PROMPT, ROW, SAMPLING, TOK, Calc, ScriptedEngine, run


class Faulty(Calc):
    """Raises ``error`` in ``method`` (reset, step or final_reward)."""

    def __init__(self, method: str, error: BaseException, **kw) -> None:
        super().__init__(**kw)
        self.method, self.error = method, error

    async def reset(self, row, seed=None):
        if self.method == "reset":
            raise self.error
        return await super().reset(row)

    async def step(self, state, turn):
        if self.method == "step":
            raise self.error
        return await super().step(state, turn)

    def final_reward(self, state, rewards, truncated):
        if self.method == "final_reward":
            raise self.error
        return super().final_reward(state, rewards, truncated)


METHODS = ["reset", "step", "final_reward"]


@pytest.mark.parametrize("method", METHODS)
def test_an_environment_error_fails_the_episode_naming_env_method_and_prompt(method):
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), Faulty(method, KeyError("x")), TOK)
    with pytest.raises(EnvironmentFault, match=f"Faulty failed in {method} on prompt id 0: KeyError"):
        run(runner)
    runner.close()


@pytest.mark.parametrize("method", METHODS)
def test_under_zero_an_environment_error_scores_zero_and_is_counted(method):
    runner = EpisodeRunner(
        ScriptedEngine(["13*17=", "221.\x01"]), Faulty(method, ValueError("x")), TOK, "zero"
    )
    comp = run(runner)
    assert comp.reward == 0.0 and any(method in t.get("env_error", "") for t in comp.turns)
    stats = runner.take_stats("train")
    assert stats["env/env_errors"] == 1 and stats[f"env/env_errors_{method}"] == 1
    assert runner.take_stats("train")["env/env_errors"] == 0  # counted once
    runner.close()


@pytest.mark.parametrize("error", [SystemExit(3), KeyboardInterrupt(), GeneratorExit()])
def test_a_base_exception_from_the_environment_never_kills_the_loop(error):
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), Faulty("step", error), TOK, "zero")
    assert run(runner).reward == 0.0
    runner.env.method = None  # the next episode runs normally on the same loop
    assert run(runner).reward == 1.0
    runner.check_health()
    runner.close()


class Blocking(Calc):
    """``step`` blocks the thread it runs on for ``seconds`` (a sync call inside async code)."""

    def __init__(self, seconds: float, **kw) -> None:
        super().__init__(**kw)
        self.seconds = seconds

    async def step(self, state, turn):
        if state["row"]["id"] == 1:
            time.sleep(self.seconds)
        return await super().step(state, turn)


def test_a_blocking_step_does_not_stall_other_episodes():
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), Blocking(1.5), TOK)
    slow = runner.submit(PROMPT, {**ROW, "id": 1}, SAMPLING, 1, "slow")
    time.sleep(0.1)
    t0 = time.monotonic()
    fast = runner.submit(PROMPT, ROW, SAMPLING, 2, "fast").result(timeout=10)
    assert fast.reward == 1.0 and time.monotonic() - t0 < 0.7
    assert slow.result(timeout=10).reward == 1.0
    runner.close()


def test_a_step_past_its_timeout_is_a_fault_within_the_timeout():
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), Blocking(3.0, call_timeout_s=0.3), TOK)
    t0 = time.monotonic()
    with pytest.raises(EnvironmentFault, match="step on prompt id 1: timed out after 0.3 s"):
        runner.submit(PROMPT, {**ROW, "id": 1}, SAMPLING, 1, "slow").result(timeout=10)
    assert time.monotonic() - t0 < 1.5
    runner.close()


class SlowSteps(Calc):
    async def step(self, state, turn):
        await asyncio.sleep(0.25)
        return Step(observation="1\n")  # never done: only the deadline ends it


def test_the_episode_deadline_bounds_its_time_in_environment_calls():
    env = SlowSteps(max_turns=50, episode_timeout_s=0.6)
    runner = EpisodeRunner(ScriptedEngine(["1*1="] * 60), env, TOK)
    t0 = time.monotonic()
    with pytest.raises(EnvironmentFault, match="step on prompt id 0"):
        run(runner, sampling=SAMPLING.__class__(max_tokens=1000))
    assert time.monotonic() - t0 < 2.0
    runner.close()


class Tracked(Calc):
    """Records ``cleanup`` calls; its step waits on ``gate`` for rows with id 7."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.cleaned: list[tuple[int, str]] = []
        self.seeds: list[int | None] = []
        self.gate = threading.Event()

    async def reset(self, row, seed=None):
        self.seeds.append(seed)
        return {"row": row}

    async def step(self, state, turn):
        if state["row"]["id"] == 7:
            while not self.gate.is_set():
                await asyncio.sleep(0.02)
        return await super().step(state, turn)

    def cleanup(self, state, reason):
        self.cleaned.append((state["row"]["id"], reason))


def test_cleanup_runs_once_on_every_way_an_episode_ends():
    env = Tracked()
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), env, TOK)
    run(runner)  # done
    run(runner, sampling=SAMPLING.__class__(max_tokens=3))  # truncated by the budget
    fut = runner.submit(PROMPT, {**ROW, "id": 7}, SAMPLING, 3, "held")  # waits in step
    time.sleep(0.2)
    fut.cancel()  # its group was cancelled or dropped while generating
    deadline = time.monotonic() + 5
    while (7, "cancelled") not in env.cleaned and time.monotonic() < deadline:
        time.sleep(0.02)
    # an aborted episode stays open until it is resumed; the runner's close cleans it
    cut = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"], cut=(0, 2)), env, TOK)
    assert run(cut).finish_reason == "abort"
    cut.close()
    held = runner.submit(PROMPT, {**ROW, "id": 7}, SAMPLING, 4, "held2")  # in flight at teardown
    time.sleep(0.2)
    runner.close()
    with pytest.raises(cf.CancelledError):
        held.result(timeout=10)
    assert env.cleaned == [(0, "done"), (0, "truncated"), (7, "cancelled"), (0, "teardown"), (7, "teardown")]


def test_an_erroring_episode_is_cleaned_up_too():
    env = Tracked()
    env.step = None  # type: ignore[assignment] - calling it raises TypeError
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), env, TOK)
    with pytest.raises(EnvironmentFault):
        run(runner)
    runner.close()
    assert env.cleaned == [(0, "error")]


class SeedEngine(ScriptedEngine):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.seeds: list[int] = []

    def submit(self, prompt_ids, sampling, seed=None, request_id=None, prompt_logprobs=False):
        self.seeds.append(seed)
        return super().submit(prompt_ids, sampling, seed, request_id, prompt_logprobs)


def test_seeds_are_distinct_per_episode_and_turn_and_reset_gets_one():
    engine, env = SeedEngine(["1*1=", "2*2=", "1.\x01"]), Tracked(max_turns=3)
    runner = EpisodeRunner(engine, env, TOK)
    base = 12345 * 1_000_003
    futs = [runner.submit(PROMPT, ROW, SAMPLING, (base + i) % 2**31, f"g0-s{i}") for i in range(8)]
    [f.result(timeout=10) for f in futs]
    runner.close()
    assert len(engine.seeds) == 24 and len(set(engine.seeds)) == 24
    assert len(set(env.seeds)) == 8 and None not in env.seeds


def test_a_dead_episode_loop_surfaces_as_one_named_error_within_seconds():
    env = Tracked()
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), env, TOK)
    held = runner.submit(PROMPT, {**ROW, "id": 7}, SAMPLING, 1, "held")
    time.sleep(0.1)

    def die() -> None:
        raise SystemExit("the loop dies")

    runner._thread._loop.call_soon_threadsafe(die)  # what a BaseException on the loop did
    with pytest.raises(EnvironmentFault, match="episode loop"):
        held.result(timeout=5)
    with pytest.raises(EnvironmentFault, match="episode loop"):
        runner.submit(PROMPT, ROW, SAMPLING, 2, "next")
    env.gate.set()
    runner.close()


def test_evaluation_errors_are_counted_apart_from_training():
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), Faulty("step", ValueError()), TOK, "zero")
    runner.submit(PROMPT, ROW, SAMPLING, 0, "e0", phase="eval").result(timeout=10)
    assert runner.take_stats("train")["env/env_errors"] == 0
    assert runner.take_stats("eval")["env/env_errors"] == 1
    runner.close()


def test_stops_and_the_episode_budget_are_checked_against_the_tokenizer_and_the_engine():
    two_token_stop = Calc()
    two_token_stop.stop = ("==",)
    check_episodes_fit(two_token_stop, TOK, len("13*17?"), 64, 512)  # a text stop (data/envs/stops.py)
    two_token_stop.stop = ("\x00=",)  # the character tokenizer decodes id 0 to nothing
    with pytest.raises(ConfigError, match="env.stop.*can produce"):
        check_episodes_fit(two_token_stop, TOK, len("13*17?"), 64, 512)
    with pytest.raises(ConfigError, match="rollout.sampling.max_tokens.*longest prompt"):
        check_episodes_fit(Calc(), TOK, 100, 64, 128)
    with pytest.raises(ConfigError, match="env.max_total_tokens"):
        check_episodes_fit(Calc(max_total_tokens=100), TOK, 40, 64, 128)
    check_episodes_fit(Calc(max_total_tokens=80), TOK, 40, 64, 128)


def test_the_episode_budget_rule_names_the_field():
    from omegaconf import OmegaConf

    def cfg(**env):
        return OmegaConf.create(
            {
                "env": env,
                "engine": {"max_model_len": 128},
                "rollout": {"sampling": {"max_tokens": 64}, "overlong": {"buffer": 0}},
            }
        )

    episode_fits_engine(cfg(max_total_tokens=100))
    with pytest.raises(ConfigError, match="env.max_total_tokens"):
        episode_fits_engine(cfg(max_total_tokens=120))
    with pytest.raises(ConfigError, match="env.max_turn_tokens"):
        episode_fits_engine(cfg(max_turn_tokens=65))


def test_a_remote_server_past_its_failure_threshold_stops_the_run_even_under_zero():
    from data.envs.http import HttpTool, RemoteDownError

    env = Calc()
    env.remote = HttpTool("http://127.0.0.1:9/", max_consecutive_failures=1)
    env.remote.down = "http://127.0.0.1:9/ failed 1 request in a row: connection refused"
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), env, TOK, "zero")
    with pytest.raises(RemoteDownError, match="127.0.0.1:9"):
        run(runner)
    runner.close()


def test_a_reward_whose_server_is_down_is_not_scored_zero():
    from types import SimpleNamespace

    from data.envs.http import RemoteDownError
    from data.rollout.sync import SyncRollout

    class DownJudge:
        def reward(self, row, response):
            raise RemoteDownError("http://judge:8000 is down after 20 failed requests")

    ctl = SyncRollout(1, 2, SAMPLING)
    ctl.configure_rewards("zero")
    ctl.ctx = SimpleNamespace(task=DownJudge())
    with pytest.raises(RemoteDownError, match="judge:8000"):
        ctl.score({"id": 3}, "42")
    assert ctl.reward_error_count == 0


def test_a_missing_model_names_the_recipe_that_builds_it(tmp_path):
    from modules.config.resources import build_command
    from modules.launch.preflight import _check_model_path

    assert build_command(tmp_path / "tiny-qwen-sft-calc") == "`python train.py recipe=sft_calculator`"
    assert "make sft" in build_command(tmp_path / "tiny-qwen-sft")
    with pytest.raises(ConfigError, match="recipe=sft_calculator"):
        _check_model_path("model.path", str(tmp_path / "tiny-qwen-sft-calc"), required=True)


# ---------------------------------------------------------------- review findings (issue 53)
class SlowReset(Tracked):
    async def reset(self, row, seed=None):
        await asyncio.sleep(0.4)
        return {"row": row, "sandbox": True}


def test_an_episode_cancelled_during_reset_is_still_cleaned_up():
    env = SlowReset()
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), env, TOK)
    fut = runner.submit(PROMPT, ROW, SAMPLING, 0, "r")
    time.sleep(0.1)
    fut.cancel()
    deadline = time.monotonic() + 5
    while not env.cleaned and time.monotonic() < deadline:
        time.sleep(0.02)
    runner.close()
    assert env.cleaned == [(0, "cancelled")]


class StepInUse(Tracked):
    """``step`` holds a resource for 0.6 s; ``cleanup`` records whether the step still held it."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.in_step = threading.Event()
        self.overlap = None

    async def step(self, state, turn):
        self.in_step.set()
        time.sleep(0.6)  # blocking: cancellation cannot interrupt it
        self.in_step.clear()
        return await super().step(state, turn)

    def cleanup(self, state, reason):
        self.overlap = self.in_step.is_set()
        super().cleanup(state, reason)


def test_cleanup_after_a_cancel_waits_for_the_step_that_still_runs():
    env = StepInUse()
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), env, TOK)
    fut = runner.submit(PROMPT, ROW, SAMPLING, 0, "r")
    assert env.in_step.wait(5)
    fut.cancel()
    deadline = time.monotonic() + 5
    while not env.cleaned and time.monotonic() < deadline:
        time.sleep(0.02)
    runner.close()
    # cleaned once, never while the step still ran ("done" when the cancel lost the race with
    # the step's end on a loaded machine: the episode had finished)
    assert len(env.cleaned) == 1 and env.cleaned[0][1] in ("cancelled", "done") and env.overlap is False


def test_environment_call_threads_are_daemons():
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), Calc(workers=3), TOK)
    run(runner)
    threads = [t for t in threading.enumerate() if t.name.startswith("asyncrl-env-call")]
    assert threads and all(t.daemon for t in threads)
    runner.close()


@pytest.mark.parametrize("recipe", ["agent_calculator", "smollm2_tools"])
def test_a_shipped_env_has_a_call_thread_for_each_tool_call_it_may_wait_on(recipe):
    """A step waiting on its tool holds an environment-call thread, so fewer threads than the
    tool's concurrency would cap the tool there (16 threads under a 256-wide tool about halved the
    agent benchmark's partial rollout): ``env.workers`` follows ``env.tools.concurrency``, 16
    without a tool runner."""
    from tests.conftest import compose

    for concurrency in (16, 256):
        env = compose([f"recipe={recipe}", f"env.tools.concurrency={concurrency}"]).env
        assert env.workers == concurrency
    assert compose([f"recipe={recipe}", "env.tools=null"]).env.workers == 16


class EarnsThenFails(Calc):
    async def step(self, state, turn):
        if turn.endswith("="):
            return Step(observation="221\n", reward=1.0)
        raise RuntimeError("broken scorer")


def test_under_zero_an_episode_with_an_error_scores_zero_whatever_it_earned_before():
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), EarnsThenFails(), TOK, "zero")
    comp = run(runner)
    assert comp.reward == 0.0 and len(comp.turns[-1]["env_errors"]) == 1
    runner.close()


class BadStep(Calc):
    def __init__(self, step, **kw) -> None:
        super().__init__(**kw)
        self.bad = step

    async def step(self, state, turn):
        return self.bad


@pytest.mark.parametrize("bad", [Step(reward=None), Step(reward="1.0x"), Step(info=[1]), "done", None])
def test_a_malformed_step_is_a_fault_not_a_crash(bad):
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), BadStep(bad), TOK, "zero")
    assert run(runner).reward == 0.0
    assert runner.take_stats()["env/env_errors_step"] == 1
    runner.close()


def test_waiting_for_a_free_thread_does_not_count_against_the_call_timeout():
    env = Blocking(0.4, call_timeout_s=0.6, workers=1)
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), env, TOK)
    futs = [runner.submit(PROMPT, {**ROW, "id": 1}, SAMPLING, i, f"r{i}") for i in range(3)]
    assert [f.result(timeout=10).reward for f in futs] == [1.0, 1.0, 1.0]
    runner.close()


def test_remote_tools_are_found_in_containers():
    from data.envs.http import HttpTool, remote_tools

    env = Calc()
    a, b, c = (HttpTool(f"http://127.0.0.1:{p}/") for p in (1, 2, 3))
    env.pool = [a]
    env.by_name = {"b": b}
    env.holder = type("Holder", (), {})()
    env.holder.client = c
    assert {t.url for t in remote_tools(env)} == {a.url, b.url, c.url}


def test_evaluation_tool_calls_are_counted_apart_from_training():
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), Calc(), TOK)
    runner.submit(PROMPT, ROW, SAMPLING, 0, "e0", phase="eval").result(timeout=10)
    assert runner.take_stats("train")["env/tool_calls"] == 0
    assert runner.take_stats("eval")["env/tool_calls"] == 1
    runner.close()


def test_an_http_tool_batches_calls_from_every_environment_thread():
    """Environment calls run on loops of their own (one per pool thread): a remote tool still
    batches them and bounds them as one client."""
    from data.envs.http import HttpTool
    from data.envs.http_server import serve

    server = serve(lambda x: x * 2)
    tool = HttpTool(server.url, batch_size=8, max_wait_s=0.2)
    results: list = []

    def caller(x: int) -> None:
        results.append(asyncio.run(tool.call(x)))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join(20) for t in threads]
    tool.close_io()
    server.stop()
    assert sorted(results) == [2 * i for i in range(8)] and tool.requests < 8


def test_overlong_keeps_an_episodes_mask_and_penalises_its_model_tokens():
    from types import SimpleNamespace

    from data.rollout.requests import Pending
    from data.rollout.shaping import Overlong
    from data.rollout.sync import SyncRollout

    ctl = SyncRollout(1, 2, SAMPLING.__class__(max_tokens=8), overlong=Overlong(buffer=4))
    ctl.ctx = SimpleNamespace(episodes=SimpleNamespace(budget=lambda sampling: 20))
    mask = [1] * 8 + [0] * 4 + [1] * 8  # 16 model tokens, 4 of observation: the budget is full
    comp = Completion(
        "r", [1], list(range(20)), [-0.5] * 20, "length", 0.0, 1.0, [(0, 0, 20)], loss_mask=mask, reward=1.0
    )
    exp = ctl.to_experience(comp, Pending({"id": 0}, 0, 0, 1, 0, prompt_ids=[1]))
    assert exp.loss_mask == mask  # observation tokens stay out of the loss
    assert exp.reward == 0.0  # 16 model tokens of the 16 the budget left them: the full penalty


def test_closing_the_runner_leaves_no_thread_behind():
    before = {t.ident for t in threading.enumerate()}
    runner = EpisodeRunner(ScriptedEngine(["13*17=", "221.\x01"]), Calc(workers=4), TOK)
    [f.result(timeout=10) for f in [runner.submit(PROMPT, ROW, SAMPLING, i, f"r{i}") for i in range(6)]]
    runner.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
        if not left:
            break
        time.sleep(0.05)
    assert not left, left
