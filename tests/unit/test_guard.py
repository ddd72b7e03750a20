"""Exit codes around ``trainer.fit`` (``modules/launch/guard.py``): an interrupt stays an interrupt.

Ctrl-C reaches the engine's process too, so shutting down after it can fail on its own (a
weight sync cut short); the run must still exit 130 (143 for SIGTERM), not 1, so a scheduler
requeues it, and a genuine failure must still surface as itself.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lightning.pytorch.utilities.exceptions import SIGTERMException

from modules.launch.guard import EXIT_CTRL_C, EXIT_SIGTERM, guarded_fit


class Datamodule:
    def __init__(self) -> None:
        self.torn_down = 0

    def teardown(self, stage: str) -> None:
        self.torn_down += 1


def run(body, rank: int = 0) -> tuple[BaseException | None, Datamodule]:
    trainer = SimpleNamespace(global_rank=rank, strategy=SimpleNamespace(launcher=None))
    dm = Datamodule()
    try:
        with guarded_fit(trainer, dm):
            body()
    except BaseException as e:  # noqa: BLE001 - the test inspects what escaped
        return e, dm
    return None, dm


def checkpointing_trainer(saved: list) -> SimpleNamespace:
    """A rank-0 trainer whose checkpoint writes land in ``saved`` (their paths)."""
    return SimpleNamespace(
        global_rank=0,
        world_size=1,
        _checkpoint_connector=SimpleNamespace(dump_checkpoint=lambda weights_only: {"step": 3}),
        strategy=SimpleNamespace(
            launcher=None, checkpoint_io=SimpleNamespace(save_checkpoint=lambda c, p: saved.append(p))
        ),
    )


def raise_during(first: BaseException, then: BaseException):
    def body() -> None:
        try:
            raise first
        except BaseException:
            raise then  # noqa: B904 - implicit chaining (__context__) is what Python does here

    return body


@pytest.mark.parametrize(
    ("first", "code"), [(KeyboardInterrupt(), EXIT_CTRL_C), (SIGTERMException(), EXIT_SIGTERM)]
)
def test_lightning_exit_after_an_interrupt_keeps_its_code(first, code):
    err, dm = run(raise_during(first, SystemExit(1)))  # Lightning's handler calls exit(1)
    assert isinstance(err, SystemExit) and err.code == code and dm.torn_down == 1
    err, _ = run(raise_during(first, SystemExit(1)), rank=1)
    assert isinstance(err, SystemExit) and err.code == 0  # DDP: other ranks exit cleanly


@pytest.mark.parametrize(
    ("first", "code"), [(KeyboardInterrupt(), EXIT_CTRL_C), (SIGTERMException(), EXIT_SIGTERM)]
)
def test_an_error_while_shutting_down_after_an_interrupt_still_exits_as_interrupted(first, code):
    err, dm = run(raise_during(first, RuntimeError("engine died during the weight sync")))
    assert isinstance(err, SystemExit) and err.code == code and dm.torn_down == 1


def test_a_real_failure_is_not_mistaken_for_an_interrupt():
    err, dm = run(raise_during(ValueError("bad batch"), RuntimeError("engine died")))
    assert isinstance(err, RuntimeError) and dm.torn_down == 1
    err, _ = run(raise_during(ValueError("x"), SystemExit(1)))
    assert isinstance(err, SystemExit) and err.code == 1


def test_an_error_that_outraces_the_ctrl_c_exits_130_and_still_checkpoints(tmp_path):
    """The engine core dies of the same SIGINT first, so the step raises its error instead of
    KeyboardInterrupt: exit 130, and CheckpointOnInterrupt writes interrupted.ckpt anyway."""
    import os
    import signal

    from modules.callbacks.checkpointing import CheckpointOnInterrupt
    from modules.callbacks.interrupts import ctrl_c_received

    saved: list = []
    trainer = checkpointing_trainer(saved)
    cb = CheckpointOnInterrupt(str(tmp_path))
    cb.on_exception(trainer, SimpleNamespace(policy=None), KeyboardInterrupt())
    assert saved == []  # interrupted before the loop started (engine start-up): nothing to save
    cb.on_train_start(trainer, SimpleNamespace(policy=None))

    def body() -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the handler records it, then raises KeyboardInterrupt
        except KeyboardInterrupt:
            pass  # ...which, in the race, never reaches the training loop
        assert ctrl_c_received()
        err = RuntimeError("vLLM engine core died (EngineCore exit code -2)")
        cb.on_exception(trainer, SimpleNamespace(policy=None), err)  # an unsharded module
        raise err

    # a suite started in the background inherits SIGINT ignored (the guard then leaves it so):
    # this test is about an interactive Ctrl-C, so give the process Python's default handler
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        err, dm = run(body)
    finally:
        signal.signal(signal.SIGINT, before)
    assert isinstance(err, SystemExit) and err.code == EXIT_CTRL_C and dm.torn_down == 1
    assert saved == [tmp_path / "interrupted.ckpt"]
    err, _ = run(lambda: None)
    assert err is None and not ctrl_c_received()  # cleared by the next fit


def test_a_hangup_is_handled_as_sigterm_outside_and_inside_the_loop():
    """SIGHUP (the terminal went away) is re-sent as SIGTERM: outside Lightning's loop ours
    raises SIGTERMException (the start-up unwinds); the previous handlers come back after."""
    import os
    import signal

    from modules.launch.guard import guarded_fit

    inherited = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a suite run under nohup inherits SIG_IGN
    before_hup, before_term = signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGTERM)
    trainer = SimpleNamespace(global_rank=0, strategy=SimpleNamespace(launcher=None))
    dm = SimpleNamespace(teardown=lambda stage: None)
    try:
        with pytest.raises(SystemExit) as info:
            with guarded_fit(trainer, dm):
                os.kill(os.getpid(), signal.SIGHUP)
                for _ in range(100):  # the SIGTERM it re-sends is delivered between bytecodes
                    sum(range(1000))
                raise AssertionError("no SIGTERM raised")
        assert info.value.code == 143
        assert isinstance(info.value.__context__, SIGTERMException) or info.value.code == 143
    finally:
        restored = (
            signal.getsignal(signal.SIGHUP) == before_hup and signal.getsignal(signal.SIGTERM) == before_term
        )
        signal.signal(signal.SIGHUP, inherited)
        assert restored


def test_a_failed_weight_sync_or_a_nan_stop_writes_no_interrupt_checkpoint(tmp_path):
    """A failure is not an interrupt: no ``interrupted.ckpt`` (the failed step's state may be
    the cause; the last periodic checkpoint is the resume point), and the error escapes the
    guard as itself (exit 1 with its message), the datamodule torn down (the engine stopped)."""
    from modules.callbacks.checkpointing import CheckpointOnInterrupt
    from modules.callbacks.weight_sync import WeightSyncError
    from modules.policy.policy_gradient import NonFiniteLossError

    saved: list = []
    trainer = checkpointing_trainer(saved)
    cb = CheckpointOnInterrupt(str(tmp_path))
    cb.on_train_start(trainer, SimpleNamespace(policy=None))
    for failure in (
        WeightSyncError("engine logprobs differ from the trainer's after syncing version 3"),
        NonFiniteLossError("3 consecutive steps had non-finite logprobs or loss"),
    ):
        cb.on_exception(trainer, SimpleNamespace(policy=None), failure)
        err, dm = run(raise_during(failure, failure))
        assert err is failure and dm.torn_down == 1
    assert saved == [] and not (tmp_path / "interrupted.ckpt").exists()


def test_a_ctrl_c_inside_a_held_block_is_raised_when_the_block_ends():
    """``ctrl_c_held`` (a rollout batch taken from the controller): the block runs to its end,
    then the KeyboardInterrupt comes; the handler before it is back in place either way."""
    import os
    import signal

    from modules.callbacks.interrupts import ctrl_c_held

    before = signal.getsignal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_held():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("first")  # the handler has run by now (it runs between bytecodes)
            done.append("second")
    assert done == ["first", "second"]
    assert signal.getsignal(signal.SIGINT) is before
    with ctrl_c_held():  # no Ctrl-C: nothing raised
        done.append("third")
    assert signal.getsignal(signal.SIGINT) is before
