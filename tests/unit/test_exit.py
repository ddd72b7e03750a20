"""train.py's exit: the exit code, the atexit handlers and the non-daemon threads of a plain exit."""

from __future__ import annotations

import pytest

from modules.launch import exit as fast_exit


class Exited(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


@pytest.fixture
def recorded(monkeypatch):
    events: list[str] = []

    def os_exit(code: int) -> None:
        events.append(f"_exit {code}")
        raise Exited(code)

    monkeypatch.setattr(fast_exit.os, "_exit", os_exit)
    monkeypatch.setattr(fast_exit.atexit, "_run_exitfuncs", lambda: events.append("atexit"))
    # the real one marks this (pytest's) main thread stopped: a subprocess runs it for real
    # (tests/integration/test_exit_process.py)
    monkeypatch.setattr(fast_exit.threading, "_shutdown", lambda: events.append("threads"))
    monkeypatch.delenv("ASYNCRL_FULL_TEARDOWN", raising=False)
    return events


@pytest.mark.parametrize(
    ("raised", "code"), [(None, 0), (SystemExit(None), 0), (SystemExit(143), 143), (SystemExit(2), 2)]
)
def test_the_exit_code_is_the_runs(recorded, raised, code):
    def main():
        if raised is not None:
            raise raised

    with pytest.raises(Exited) as e:
        fast_exit.exit_when_done(main)
    assert e.value.code == code
    assert recorded == ["threads", "atexit", f"_exit {code}"]  # as the interpreter orders them


def test_a_message_exit_prints_it_and_exits_1(recorded, capsys):
    with pytest.raises(Exited) as e:
        fast_exit.exit_when_done(lambda: exec("raise SystemExit('stopped: reason')"))
    assert e.value.code == 1 and "stopped: reason" in capsys.readouterr().err


def test_another_exception_is_not_swallowed(recorded):
    with pytest.raises(ZeroDivisionError):
        fast_exit.exit_when_done(lambda: 1 / 0)
    assert recorded == []  # the interpreter's own exit prints it and tears down


def test_full_teardown_on_request_is_a_plain_sys_exit(recorded, monkeypatch):
    monkeypatch.setenv("ASYNCRL_FULL_TEARDOWN", "1")
    with pytest.raises(SystemExit) as e:
        fast_exit.exit_when_done(lambda: exec("raise SystemExit(143)"))
    assert e.value.code == 143 and recorded == []
