"""The quiet console (modules/launch/quiet.py): installed once, narrow (the project's warnings and
other libraries' real ones still show); the step progress bar; the framed held-out summary."""

from __future__ import annotations

import logging
import os
import warnings
from types import SimpleNamespace

import pytest

from modules.launch import quiet


@pytest.fixture
def fresh_quiet(monkeypatch):
    """``quiet_console`` as in a new process; its filters removed again afterwards."""
    monkeypatch.setattr(quiet, "_installed", False)
    loggers = [logging.getLogger(n) for n in list(logging.Logger.manager.loggerDict)] + [logging.getLogger()]
    before = {id(lg): list(lg.filters) for lg in loggers}
    with warnings.catch_warnings():  # restores the warning filters
        yield
    for lg in [logging.getLogger(n) for n in list(logging.Logger.manager.loggerDict)]:
        lg.filters = before.get(id(lg), [])


def drops(logger: str, message: str, level: int = logging.WARNING) -> bool:
    lg = logging.getLogger(logger)
    record = lg.makeRecord(logger, level, __file__, 1, message, (), None)
    return not lg.filter(record)


def test_installed_once(fresh_quiet):
    assert quiet.quiet_console() is True
    n_warnings = len(warnings.filters)
    n_logging = len(logging.getLogger("vllm.config.vllm").filters)
    assert quiet.quiet_console() is False  # a second call (a re-import) adds nothing
    assert len(warnings.filters) == n_warnings
    assert len(logging.getLogger("vllm.config.vllm").filters) == n_logging


def test_named_notices_are_dropped_and_everything_else_shows(fresh_quiet):
    quiet.quiet_console()
    assert drops("lightning.pytorch.utilities.rank_zero", "💡 Tip: For seamless cloud logging ...")
    assert drops("vllm.v1.worker.cpu_worker", "libtcmalloc is not found in LD_PRELOAD. For best performance")
    assert drops("vllm.engine.arg_utils", "This model does not officially support disabling chunked prefill.")
    # the same loggers' other messages, and the project's own warnings, still show
    assert not drops("lightning.pytorch.utilities.rank_zero", "`Trainer.fit` stopped: `max_steps=3` reached.")
    assert not drops("vllm.v1.worker.cpu_worker", "Node 0 is not in available memory nodes [1].")
    assert not drops("modules.launch.validate", "rollout.group_size=1: every advantage is 0", logging.WARNING)
    assert not drops("modules.launch.validate", "any error", logging.ERROR)


def test_python_warnings_filtered_by_message_and_category(fresh_quiet):
    quiet.quiet_console()
    with warnings.catch_warnings(record=True) as seen:
        warnings.filterwarnings("always", append=True)  # behind the quiet filters: the rest all show
        for message, category in (
            ("You are using the `dataloader_iter` step flavor. If you consume ...", UserWarning),
            ("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning),
            ("`isinstance(treespec, LeafSpec)` is deprecated, use ...", RuntimeWarning),  # another category
            ("a warning of the project's own", UserWarning),
            ("Node 0 is not in available memory nodes [1].", UserWarning),  # another message
        ):
            warnings.warn(message, category, stacklevel=1)
    assert [(type(w.message), str(w.message)) for w in seen] == [
        (RuntimeWarning, "`isinstance(treespec, LeafSpec)` is deprecated, use ..."),
        (UserWarning, "a warning of the project's own"),
        (UserWarning, "Node 0 is not in available memory nodes [1]."),
    ]


@pytest.mark.parametrize("old_metrics", [False, True])
def test_run_dir_notice_only_silenced_while_nothing_would_be_deleted(fresh_quiet, tmp_path, old_metrics):
    """Hydra's run dir holds .hydra/ and train.log before the CSV logger starts: no reason to warn;
    a metrics.csv of an earlier run there (the logger deletes it) still warns."""
    (tmp_path / ".hydra").mkdir()
    if old_metrics:
        (tmp_path / "metrics.csv").write_text("step\n")
    quiet.quiet_run_dir(str(tmp_path))
    with warnings.catch_warnings(record=True) as seen:
        warnings.filterwarnings("always", append=True)
        for where in (tmp_path, tmp_path.parent / "elsewhere"):  # another dir: always shown
            warnings.warn(
                f"Experiment logs directory {where}/ exists and is not empty. ...", UserWarning, stacklevel=1
            )
    assert len(seen) == (2 if old_metrics else 1)


@pytest.mark.parametrize("spawned", [False, True])
def test_cpp_warnings_quieted_only_in_spawned_processes(fresh_quiet, monkeypatch, spawned):
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    quiet.quiet_console(spawned=spawned)
    assert os.environ.get("TORCH_CPP_LOG_LEVEL") == ("ERROR" if spawned else None)


def test_train_py_installs_it_at_import_for_spawned_processes():
    """The call sits at module level (a spawned process imports train.py as __mp_main__)."""
    import ast

    from tests.conftest import ROOT

    tree = ast.parse((ROOT / "train.py").read_text())
    calls = [
        n.value.func.id
        for n in tree.body
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)
    ]
    assert "quiet_console" in calls


def test_step_progress_bar_counts_optimizer_steps_of_max_steps():
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    from modules.callbacks.progress import StepProgressBar

    bar = StepProgressBar()
    trainer = L.Trainer(
        max_steps=5, max_epochs=-1, callbacks=[bar], logger=False, enable_checkpointing=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(BoringModel())
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.description, task.completed, task.total) == ("step", 5, 5)
    assert bar.total_train_batches == 5


def test_held_out_summary_is_framed_and_last_only_after_two_evaluations():
    from modules.callbacks.held_out import HeldOutEval, framed, held_out_summary

    assert framed(["ab", "abcd"]).splitlines() == ["┌──────┐", "│ ab   │", "│ abcd │", "└──────┘"]
    ev = HeldOutEval(every_n_versions=0)
    trainer = SimpleNamespace(callbacks=[ev])
    assert held_out_summary(trainer) is None  # no before / after yet
    ev.summary = ["held-out sampled reward 0.386 -> 0.742"]
    assert held_out_summary(trainer).splitlines()[1] == "│ held-out sampled reward 0.386 -> 0.742 │"
