"""Where an engine's vLLM sockets go (`rlserve.engine.process_group.SocketDir`), no engine: a
directory of the server's own, removed at its shutdown, and by the next server's start when
its server was killed outright. (An engine's sockets landing there, and nothing left after a
clean stop: tests/test_shutdown.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlserve.engine import owned_dir
from rlserve.engine.owned_dir import remove_abandoned
from rlserve.engine.process_group import RPC_BASE_ENV, SOCKET_DIR_PREFIX, SocketDir

from helpers import short_temp_dir

HOLD = """
import sys, time
from rlserve.engine.process_group import SocketDir
d = SocketDir()
print(d.path, flush=True)
time.sleep(600)
"""


@pytest.fixture
def temp_dir(monkeypatch) -> Iterator[Path]:
    """The temp dir, here and in the processes this test starts: a short path (pytest's own
    are too long for a socket in a directory inside them)."""
    with short_temp_dir("sockets-") as path:
        monkeypatch.setattr(tempfile, "tempdir", str(path))
        monkeypatch.setenv("TMPDIR", str(path))
        monkeypatch.delenv(RPC_BASE_ENV, raising=False)
        yield path


def holder() -> tuple[subprocess.Popen, Path]:
    """A process that made a SocketDir and holds it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    return proc, Path(proc.stdout.readline().strip())


def aged(path: Path) -> Path:
    """As if made two minutes ago (a younger one may not be locked yet: never removed)."""
    then = time.time() - 2 * owned_dir.ABANDONED_AFTER_S
    os.utime(path, (then, then))
    return path


def test_an_engine_gets_a_private_directory_while_it_starts_and_it_is_removed(temp_dir):
    sockets = SocketDir()
    assert sockets.path is not None and sockets.path.parent == temp_dir
    assert sockets.path.stat().st_mode & 0o777 == 0o700
    with sockets.in_use():
        assert os.environ[RPC_BASE_ENV] == str(sockets.path)
        (sockets.path / "a-socket").touch()
    assert RPC_BASE_ENV not in os.environ  # the next engine gets its own
    sockets.remove()
    assert not sockets.path.exists()


def test_a_failed_start_removes_its_directory(temp_dir):
    sockets = SocketDir()
    with pytest.raises(RuntimeError), sockets.in_use():
        raise RuntimeError("the engine did not start")
    assert sockets.path is not None and not sockets.path.exists() and RPC_BASE_ENV not in os.environ


def test_a_path_someone_set_is_theirs(temp_dir, monkeypatch):
    monkeypatch.setenv(RPC_BASE_ENV, str(temp_dir / "theirs"))
    sockets = SocketDir()
    with sockets.in_use():
        assert os.environ[RPC_BASE_ENV] == str(temp_dir / "theirs")
    sockets.remove()
    assert sockets.path is None and list(temp_dir.iterdir()) == []


def test_only_directories_whose_server_died_are_removed(temp_dir):
    killed, killed_dir = holder()
    alive, alive_dir = holder()
    young, young_dir = holder()
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        aged(killed_dir)
        aged(alive_dir)
        young.send_signal(signal.SIGKILL)
        young.wait()
        # Not ours to touch: a file, a symlink to a directory, a directory without a lock.
        (temp_dir / "rlserve-engine-file").touch()
        (temp_dir / "rlserve-engine-link").symlink_to(alive_dir)
        aged_dir(temp_dir / "rlserve-engine-nolock")
        SocketDir().remove()  # a server starting on this host sweeps
        assert not killed_dir.exists()
        assert alive_dir.exists() and young_dir.exists()
        assert {p.name for p in temp_dir.iterdir()} == {
            alive_dir.name,
            young_dir.name,
            "rlserve-engine-file",
            "rlserve-engine-link",
            "rlserve-engine-nolock",
        }
        assert remove_abandoned(SOCKET_DIR_PREFIX) == []
    finally:
        for proc in (killed, alive, young):
            proc.kill()
            proc.wait()


def aged_dir(path: Path) -> Path:
    path.mkdir()
    return aged(path)


def test_a_temp_dir_too_long_for_a_socket_inside_it_is_left_to_vllm(tmp_path, monkeypatch):
    """A socket's path has at most 107 bytes: where the directory would push vLLM's past that,
    vLLM keeps its own place (the engine starts as it did without rlserve)."""
    deep = tmp_path / ("d" * (100 - len(str(tmp_path))))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.delenv(RPC_BASE_ENV, raising=False)
    sockets = SocketDir()
    with sockets.in_use():
        assert RPC_BASE_ENV not in os.environ
    assert sockets.path is None and list(deep.iterdir()) == []


HUB = """
import asyncio
from rlserve.engine.notices import NotificationHub
hub = NotificationHub()
asyncio.run(hub.start())
print(hub.address, flush=True)
import time; time.sleep(600)
"""


def test_a_killed_servers_notice_socket_directory_is_removed_by_the_next_one(temp_dir):
    """The workers' notice socket lives in a directory of the same kind (one a killed server
    left was in /tmp 125 times here)."""
    from rlserve.engine.notices import NOTIFY_DIR_PREFIX, NotificationHub

    proc = subprocess.Popen([sys.executable, "-c", HUB], stdout=subprocess.PIPE, text=True)
    try:
        left = Path(proc.stdout.readline().strip()).parent
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert left.name.startswith(NOTIFY_DIR_PREFIX) and left.exists()
        aged(left)
        hub = NotificationHub()
        assert not left.exists()
        asyncio.run(hub.close())
        assert list(temp_dir.iterdir()) == []
    finally:
        proc.kill()
        proc.wait()
