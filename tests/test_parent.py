"""`rlserve.parent`: which process started this one (`take_launcher_pid`) and whether it is
gone (`is_gone`), without an engine. `tests/test_shutdown.py` runs them in real servers."""

from __future__ import annotations

import os
import subprocess
import sys

from rlserve.parent import LAUNCHER_PID_ENV, is_gone, take_launcher_pid


def test_the_launcher_named_in_the_environment_is_taken_out_of_it(monkeypatch):
    monkeypatch.setenv(LAUNCHER_PID_ENV, "4242")
    assert take_launcher_pid() == 4242
    assert LAUNCHER_PID_ENV not in os.environ, "the processes this one starts would inherit it"
    assert take_launcher_pid() == os.getppid()


def test_a_launcher_named_wrongly_is_the_parent(monkeypatch):
    monkeypatch.setenv(LAUNCHER_PID_ENV, "not a pid")
    assert take_launcher_pid() == os.getppid()


def test_a_parent_or_a_launcher_behind_a_wrapper_is_not_gone():
    assert not is_gone(os.getppid())
    # Alive but not this process's parent: a launcher that started it through `nohup`, say.
    assert not is_gone(os.getpid())


def test_a_launcher_that_exited_is_gone_reaped_or_not():
    reaped = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped.wait()
    assert is_gone(reaped.pid)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
    try:
        assert is_gone(zombie.pid)
    finally:
        zombie.wait()
