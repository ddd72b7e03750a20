"""How ``lab.drift_grid`` keeps its runs: --resume, the committed run store, builds of the warm
start read side by side, and two workers on one grid (hand-made run directories; helpers from
``test_drift_bench``)."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from tests.tools.test_drift_bench import rows_of, write_run


def test_resume_skips_finished_seeds_and_clears_a_killed_one(tmp_path):
    from lab.drift_cells import cell_spec
    from lab.drift_store import pending_seeds
    from lab.modes_run import run_dir_name

    spec = cell_spec(2, "tis")
    finished = write_run(tmp_path / run_dir_name(spec) / "seed0", rows_of([0.5] * 5), 0.6)
    (finished / "heldout_curve.json").write_text("{}")
    killed = write_run(tmp_path / run_dir_name(spec) / "seed1", rows_of([0.5] * 5), None)
    assert pending_seeds(tmp_path, spec, [0, 1, 2]) == [1, 2]
    assert finished.exists() and not killed.exists()


def drifting_rows() -> list[dict[str, str]]:
    """40 trained steps at lag 1 with every signal the detector and the diagnostics read, the
    behaviour KL and weights blowing up from step 20 (so the detector alarms), the reward
    falling from step 25 (so the collapse is dated)."""
    rows = rows_of([0.5] * 25 + [0.0] * 15)
    for i, r in enumerate(rows):
        bad = i >= 20
        r.update(
            {
                "train/kl_behavior": str(0.5 if bad else 0.01 + 0.001 * (i % 3)),
                "train/clip_frac": str(0.3 if bad else 0.01),
                "train/grad_norm": str(50.0 if bad else 1.0 + 0.1 * (i % 2)),
                "is/ess_frac": str(0.05 if bad else 0.95),
                "is/zeroed_frac": "0.01",
                "is/weight_max": str(100.0 if bad else 2.0),
                "mismatch/k3": str(0.1 if bad else 1e-4),
                "rollout/staleness_max": "1",
                "perf/samples_per_s": "3.5",
                "perf/other": "7",
            }
        )
    return [*rows, {"step": "40", "perf/other": "8"}]  # a row with nothing kept


def test_a_stored_run_reads_as_its_directory_and_resume_skips_it(tmp_path):
    """The committed store (lab/run_store.py) stands in for a run directory a new
    checkout no longer has: the same outcome (alarm, collapse, diagnostics), the same table
    cell, and --resume skips it."""
    from lab import run_store
    from lab.drift_cells import cell_spec
    from lab.drift_store import archive, pending_seeds
    from lab.drift_table import table
    from lab.modes_run import run_dir_name

    out, store = tmp_path / "grid", tmp_path / "store.jsonl"
    spec = cell_spec(1, "tis")
    start = {"eval/sampled_reward_mean": 0.4}
    (out / "initial_eval").mkdir(parents=True)
    (out / "initial_eval" / "x.json").write_text(json.dumps({"metrics": start}))
    for seed, final in [(0, 0.2), (1, 0.6)]:
        run = write_run(out / run_dir_name(spec) / f"seed{seed}", drifting_rows(), final)
        (run / "heldout_curve.json").write_text("{}")
        summary = json.loads((run / "eval_summary.json").read_text())
        (run / "eval_summary.json").write_text(json.dumps({**summary, "first": start}))
    write_run(out / run_dir_name(spec) / "seed2", rows_of([0.5] * 5), None)  # crashed
    write_run(out / run_dir_name(spec) / "seed3", rows_of([0.5] * 12), None)  # diverged
    results = [
        {"seed": 0},
        {"seed": 1},
        {"seed": 2, "failed": True, "diverged": False, "error": "EngineDeadError"},
        {"seed": 3, "failed": True, "diverged": True, "error": "NonFiniteLossError: 3 consecutive"},
    ]
    stored: dict = {}
    setup = {"overrides": ["module.optimizer.lr=3e-3"], "eval_every": 60, "commit": "abc"}
    archive(out, spec, results, store, stored, setup)
    archive(out, spec, results, store, stored, setup)  # idempotent: nothing stored twice
    loaded = run_store.load(store)
    assert sorted(loaded) == [(spec, 0), (spec, 1), (spec, 3)]  # the crash is left to rerun
    assert len(store.read_text().splitlines()) == 3
    assert loaded[(spec, 3)]["last"] is None and loaded[(spec, 3)]["start_sampled"] is None
    assert loaded[(spec, 0)]["start_sampled"] == 0.4 and loaded[(spec, 0)]["overrides"] == setup["overrides"]
    kept = loaded[(spec, 0)]["rows"]
    assert len(kept) == 41 and kept[-1] == {"step": "40"} and "perf/other" not in kept[0]
    seeds = [0, 1, 2, 3]
    from_dirs = table(out, [spec], seeds, 0.15, {"threshold": 4.0})["cells"][spec]
    # with a store, a directory with no curve that is not stored is unfinished: left out
    both = table(out, [spec], seeds, 0.15, {"threshold": 4.0}, loaded)["cells"][spec]
    assert [r["seed"] for r in both["runs"]] == [0, 1, 3] and both["missing_seeds"] == [2]
    shutil.rmtree(out)  # a fresh checkout: only the store
    from_store = table(out, [spec], seeds, 0.15, {"threshold": 4.0}, loaded)["cells"][spec]
    same = [r for r in from_dirs["runs"] if r["seed"] != 2]
    assert json.dumps(from_store["runs"]) == json.dumps(same)
    run0 = from_store["runs"][0]
    assert run0["first_alarm"] is not None and run0["collapse_step"] is not None and run0["lead_steps"] > 0
    assert all(math.isfinite(v) for v in run0["diagnostics"].values())
    assert from_store["runs"][2]["collapse_rule"] == "stopped"
    assert pending_seeds(out, spec, seeds, loaded) == [2]


def test_a_line_cut_short_is_skipped_and_the_next_record_is_whole(tmp_path, capsys):
    from lab import run_store

    store = tmp_path / "store.jsonl"
    run_store.append(store, {"spec": "a", "seed": 0, "rows": []})
    with open(store, "a") as f:
        f.write('{"spec": "a", "seed": 1, "ro')  # a writer killed mid-line
    run_store.append(store, {"spec": "a", "seed": 2, "rows": []})
    assert sorted(run_store.load(store)) == [("a", 0), ("a", 2)]
    assert "line 2 is cut short" in capsys.readouterr().err


def test_a_store_of_another_setup_is_refused(tmp_path):
    from lab.drift_cells import cell_spec
    from lab.drift_store import check_setup

    spec = cell_spec(1, "tis")
    stored = {(spec, 0): {"overrides": ["module.optimizer.lr=2e-3"], "eval_every": 60}}
    ok = {"overrides": ["module.optimizer.lr=2e-3"], "eval_every": 60, "commit": "x"}
    check_setup(stored, [spec], ok)
    check_setup(stored, [cell_spec(2, "tis")], {**ok, "eval_every": 20})  # other cells: not ours
    with pytest.raises(SystemExit, match="lr=2e-3"):
        check_setup(stored, [spec], {**ok, "overrides": ["module.optimizer.lr=3e-3"]})


def test_runs_from_different_warm_starts_are_refused(tmp_path):
    from lab.drift_store import start_reward

    (tmp_path / "initial_eval").mkdir()
    (tmp_path / "initial_eval" / "x.json").write_text(
        json.dumps({"metrics": {"eval/sampled_reward_mean": 0.4}})
    )
    # a run that stopped before its evaluation has no start: ignored, not a second warm start
    assert (
        start_reward(tmp_path, {("a", 0): {"start_sampled": 0.4}, ("a", 1): {"start_sampled": None}}) == 0.4
    )
    with pytest.raises(SystemExit, match="different warm starts"):
        start_reward(tmp_path, {("a", 0): {"start_sampled": 0.387}})
    assert start_reward(tmp_path / "none", {("a", 0): {"start_sampled": 0.387}}) == 0.387
    assert math.isnan(start_reward(tmp_path / "none", {}))


def test_another_build_of_the_warm_start_is_read_from_its_own_store_and_paired_within_it(tmp_path):
    """A warm start rebuilt on another machine evaluates a little differently. One store holds
    one build (mixing is refused); another build's store is read beside it: its runs join the
    cells, are judged against their own start, and pair only with runs of their own build. The
    store keeps the build's weight hash."""
    from lab import run_store
    from lab.drift_cells import cell_spec
    from lab.drift_report import markdown
    from lab.drift_table import table

    k0, k2 = cell_spec(0, "bypass"), cell_spec(2, "bypass")
    run = write_run(tmp_path / "runs" / "seed0", rows_of([0.5] * 20), 0.41)
    (run / "eval_summary.json").write_text(
        json.dumps({"first": {"eval/sampled_reward_mean": 0.40}, "last": {"eval/sampled_reward_mean": 0.41}})
    )
    (run / "heldout_curve.json").write_text(json.dumps({"initial_weights": "abc123"}))
    rec = run_store.record(run, k0, 0, {"overrides": [], "eval_every": 20, "commit": "x"})
    assert rec["warm_start"] == "abc123" and rec["start_sampled"] == 0.40

    def at(spec, seed, start, final, greedy=0.9):
        return {
            **rec,
            "spec": spec,
            "seed": seed,
            "start_sampled": start,
            "last": {"eval/sampled_reward_mean": final, "eval/reward_mean": greedy},
        }

    # build A (read beside): K = 0 and K = 2, seeds 0-1; build B (the store written now): K = 2
    # seeds 0-1, no K = 0 of its own yet, and its start 0.42
    build_a = {
        (k0, 0): at(k0, 0, 0.40, 0.60),
        (k0, 1): at(k0, 1, 0.40, 0.70),
        (k2, 0): at(k2, 0, 0.40, 0.50),
        (k2, 1): at(k2, 1, 0.40, 0.65),
    }
    build_b = {(k2, 0): at(k2, 0, 0.42, 0.41), (k2, 1): at(k2, 1, 0.42, 0.90)}
    out = tmp_path / "fresh"  # a new checkout: the stores only
    with pytest.raises(SystemExit, match="--with-store"):
        table(out, [k0, k2], [0, 1], 0.15, {}, {**build_a, (k2, 5): at(k2, 5, 0.42, 0.5)})
    cells = table(out, [k0, k2], [0, 1], 0.15, {}, build_b, [build_a])["cells"]
    runs = cells[k2]["runs"]
    assert [(r["seed"], r["build"]) for r in runs] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [r["collapsed"] for r in runs] == [True, False, False, False]  # 0.41 < its own 0.42
    assert cells[k2]["other_build"] == 2 and cells[k0]["other_build"] == 2
    # paired only within build A (diffs -0.10, -0.05); build B has no K = 0 to pair with
    assert cells[k2]["vs_k0"]["n"] == 2 and abs(cells[k2]["vs_k0"]["mean"] + 0.075) < 1e-12
    assert abs(cells[k2]["final_sampled_mean"] - (0.41 + 0.90 + 0.50 + 0.65) / 4) < 1e-12
    assert "(2 of another build)" in markdown(cells, 0.42)
    with pytest.raises(SystemExit, match="count twice"):  # one build read twice
        table(out, [k0, k2], [0, 1], 0.15, {}, build_b, [build_a, dict(build_a)])
    with pytest.raises(SystemExit, match="no run with a warm-start evaluation"):
        table(out, [k0, k2], [0, 1], 0.15, {}, build_b, [{(k0, 0): {**rec, "start_sampled": None}}])


def test_a_run_of_another_build_is_not_appended_to_the_store(tmp_path):
    """A machine whose rebuilt warm start differs (its hash, or for older records its held-out
    start) cannot add its runs to a store of another build: the store stays one build."""
    from lab.drift_cells import cell_spec
    from lab.drift_store import archive, other_build

    spec = cell_spec(2, "tis")
    run = write_run(tmp_path / "out" / "x", rows_of([0.5] * 5), 0.6)
    stored_a = {(spec, 0): {"start_sampled": 0.3867, "warm_start": None}}
    assert "evaluates at 0.385900" in other_build({"start_sampled": 0.3859, "warm_start": "b"}, stored_a)
    assert other_build({"start_sampled": 0.3867, "warm_start": "b"}, stored_a) is None
    stored_b = {(spec, 0): {"start_sampled": 0.3859, "warm_start": "bbb"}}
    assert "weights" in other_build({"start_sampled": 0.3859, "warm_start": "ccc"}, stored_b)
    assert other_build({"start_sampled": None, "warm_start": None}, stored_b) is None  # a diverged run
    # archive refuses, and writes nothing
    from lab.modes_run import run_dir_name

    run_dir = tmp_path / "out" / run_dir_name(spec) / "seed1"
    shutil.copytree(run, run_dir)
    (run_dir / "eval_summary.json").write_text(
        json.dumps({"first": {"eval/sampled_reward_mean": 0.3859}, "last": {"eval/sampled_reward_mean": 0.6}})
    )
    (run_dir / "heldout_curve.json").write_text(json.dumps({"initial_weights": "ccc"}))
    store = tmp_path / "store.jsonl"
    with pytest.raises(SystemExit, match="its own store"):
        archive(
            tmp_path / "out", spec, [{"seed": 1}], store, dict(stored_b), {"overrides": [], "eval_every": 20}
        )
    assert not store.exists()


def test_a_run_another_worker_holds_is_left_to_it(tmp_path):
    """Two workers on one cell: the second skips the seed the first is running (one directory
    per run), and takes it once the first lets go."""
    import fcntl

    from lab.drift_cells import cell_spec
    from lab.drift_store import run_lock
    from lab.modes_run import run_dir_name

    spec = cell_spec(1, "ds_seq_mask")
    with run_lock(tmp_path, spec, 2) as first:
        assert first
        with run_lock(tmp_path, spec, 2) as second:  # a second open file: as another process
            assert not second
        with run_lock(tmp_path, spec, 1) as other_seed:
            assert other_seed
    with run_lock(tmp_path, spec, 2) as again:
        assert again
    with open(tmp_path / run_dir_name(spec) / "seed2.lock") as f:  # released on exit
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_sweep_leaves_a_run_another_worker_is_finishing(tmp_path):
    """``--analyze`` with a store sweeps in finished runs the store lacks. A run whose worker
    still holds its lock, or that has its held-out curve but not yet the summary written after
    it, is not stored (it once was: a record with no evaluation, read as a stopped run)."""
    import fcntl

    from lab import run_store
    from lab.drift_cells import cell_spec
    from lab.drift_store import sweep
    from lab.modes_run import run_dir_name

    out, store = tmp_path / "grid", tmp_path / "store.jsonl"
    spec = cell_spec(0, "tis")
    setup = {"overrides": [], "eval_every": 60, "commit": "abc"}
    for seed in (0, 1):
        run = write_run(out / run_dir_name(spec) / f"seed{seed}", rows_of([0.5] * 5), 0.6)
        (run / "heldout_curve.json").write_text("{}")
    half = write_run(out / run_dir_name(spec) / "seed2", rows_of([0.5] * 5), None)
    (half / "heldout_curve.json").write_text("{}")  # its summary is not written yet
    with open(out / run_dir_name(spec) / "seed1.lock", "w") as held:  # a worker finishing seed 1
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        stored: dict = {}
        sweep(out, [spec], [0, 1, 2], store, stored, setup)
    assert sorted(run_store.load(store)) == [(spec, 0)]
    sweep(out, [spec], [0, 1, 2], store, stored, setup)  # released: now it is swept
    loaded = run_store.load(store)
    assert sorted(loaded) == [(spec, 0), (spec, 1)] and loaded[(spec, 1)]["last"] is not None
