"""The simulator on a multi-turn run (tools/episode_workload.py): episodes as requests of their
measured duration, predicted against the barrier's analytical cost."""

from __future__ import annotations

import json
import random

import pytest

from tools.episode_workload import fit_episodes, predict_episodes, validate_episodes
from tools.workload import Workload

SYNC = ["recipe=agent_calculator", "rollout=sync", "~rollout.max_staleness"]


def write_run(
    run,
    overrides: list[str],
    durations: list[list[float]],
    step_s: float,
    sps: float,
    engine_idle: float = 0.0,
):
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- '{o}'\n" for o in overrides))
    with open(run / "experiences.jsonl", "w") as f:
        for g, group in enumerate(durations):
            for s, d in enumerate(group):
                rec = {"group": g, "sample": s, "level": g % 3, "gen_start": 100.0, "gen_end": 100.0 + d}
                f.write(json.dumps(rec) + "\n")
    rows = [
        "step,perf/step_s,perf/step_wait_s,perf/samples_per_s,perf/trainer_idle_frac,perf/engine_idle_frac"
    ]
    rows += [f"{i},{step_s + 1.0},1.0,{sps},0.1,{engine_idle}" for i in range(10)]
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    return run


def test_a_fitted_run_predicts_the_barrier_and_the_pipeline(tmp_path):
    """Episodes of 0.3 s and a trainer busy 0.2 s a step: sync waits 0.3 s for each batch
    and then steps (128 / 0.5 s); streaming overlaps the two and is trainer-bound (128 / 0.2 s)."""
    run = write_run(tmp_path / "sync", [*SYNC, "seed=0"], [[0.3] * 8] * 40, 0.2, 250.0)
    work = fit_episodes([run])
    assert work.step_time == pytest.approx(0.2)
    assert {n for _, g in work.groups for n in g} == {30}  # 0.3 s in units of 10 ms
    sync = predict_episodes(work, run_config_of(SYNC), steps=20)
    assert sync["samples_per_unit"] == pytest.approx(128 / (0.3 + 0.2), rel=0.02)
    stream = predict_episodes(work, run_config_of(["recipe=agent_calculator"]), steps=20)
    assert stream["samples_per_unit"] == pytest.approx(128 / 0.2, rel=0.1)
    (row,) = validate_episodes(work, [run], seeds=1)
    assert row["sync"] and row["measured_samples_per_s"] == 250.0
    assert row["measured_speedup_vs_sync"] == 1.0 and row["predicted_speedup_vs_sync"] == 1.0


def test_a_heavy_tail_costs_the_barrier_most():
    """One episode in 50 takes 3 s, the rest 0.1 s: every sync batch of 128 almost surely
    holds one (1 - 0.98^128 = 92 %), so sync steps at about 3 s; streaming keeps the tail in
    flight across syncs and partial rollout carries it over."""
    rng = random.Random(0)
    groups = [(0, [300 if rng.random() < 0.02 else 10 for _ in range(8)]) for _ in range(400)]
    work = Workload(groups=groups, step_cost=(0.01, 0.0), prefill_iterations=0.0, step_time=0.2)
    sync = predict_episodes(work, run_config_of(SYNC), steps=30)["samples_per_unit"]
    assert 128 / (3.0 + 0.2) * 0.9 < sync < 128 / (0.1 + 0.2)
    for mode in (["recipe=agent_calculator"], ["recipe=agent_calculator", "rollout=partial"]):
        faster = predict_episodes(work, run_config_of(mode), steps=30)["samples_per_unit"]
        assert faster > 2.5 * sync, mode


def run_config_of(overrides: list[str]):
    from modules.launch.compose import compose

    return compose(overrides)


def test_an_overlapped_run_adds_the_trainers_slowdown_on_a_shared_machine(tmp_path):
    """Sync: the trainer alone, 0.2 s a step. Streaming: 0.32 s a step while the engine is busy
    90 % of the time, so step = 0.2 (1 + t 0.9) gives t = 2/3; durations still from sync only."""
    sync = write_run(tmp_path / "sync", [*SYNC, "seed=0"], [[0.3] * 8] * 40, 0.2, 250.0)
    stream = write_run(
        tmp_path / "stream", ["recipe=agent_calculator", "seed=0"], [[9.0] * 8] * 40, 0.32, 300.0, 0.1
    )
    work = fit_episodes([sync, stream])
    assert work.step_time == pytest.approx(0.2) and work.contention == (0.0, pytest.approx(2 / 3))
    assert {n for _, g in work.groups for n in g} == {30}  # the streaming run's durations unused
    alone = fit_episodes([sync])
    shared = predict_episodes(work, run_config_of(["recipe=agent_calculator"]), steps=20)
    free = predict_episodes(alone, run_config_of(["recipe=agent_calculator"]), steps=20)
    assert shared["samples_per_unit"] < 0.8 * free["samples_per_unit"]
