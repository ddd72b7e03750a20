"""The TRL peer benchmark's pieces that run without TRL: which settings it can mirror, and the
run directory it writes (read by ``tools.heldout_curve`` and ``lab.modes``)."""

from __future__ import annotations

import math

import pytest

from tests.conftest import compose
from tools.trl_peer import check_matchable, write_run


def test_the_sync_recipe_is_mirrored_and_other_settings_are_refused_by_field():
    check_matchable(compose(["recipe=sync_grpo"]))
    for override, field in [
        ("algo.minibatches=2", "algo.minibatches"),
        ("algo.loss.anchor=decoupled", "algo.loss.anchor"),
        ("algo.loss.aggregation=seq_mean_token_mean", "algo.loss.aggregation"),
        ("algo/correction=tis", "algo/correction"),
        ("algo/objective=cispo", "algo/objective"),
    ]:
        with pytest.raises(SystemExit, match=field):
            check_matchable(compose(["recipe=sync_grpo", override]))


def test_the_run_directory_reads_like_a_train_py_run(tmp_path):
    from lab.modes import last, read_metrics
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
