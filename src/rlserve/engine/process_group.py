"""Start vLLM's engine processes in a process group of their own.

A signal sent to the server's whole process group (systemd's default `KillMode`, `kill --
-PGID`, Ctrl-C in a terminal) would otherwise reach vLLM's engine core and workers directly:
they exit at once and every request in flight ends with an engine-dead error, while the server
itself was about to drain them. In a group of their own the engine processes hear only the
server, which drains, then shuts the engine down. They still exit when the server dies (vLLM
watches its parent).

vLLM starts its engine core with multiprocessing's spawn, which has no pre-exec hook; so for
the duration of the start, spawn's interpreter is a small launcher that moves itself into a
new process group (not a new session: that would change how the kernel shares the CPU) and
then execs the real interpreter with the same arguments.

vLLM's engine processes also talk over Unix sockets named by uuid under `VLLM_RPC_BASE_PATH`
(/tmp unless set), and leave them there: seven files each time an engine starts and stops.
`SocketDir` gives one engine a directory of its own for them, removed at its shutdown (or by
the next server's start on the host, if its server was killed outright).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

_LAUNCHER = """#!{python}
import os, sys
os.setpgid(0, 0)
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""
_lock = threading.Lock()


@contextlib.contextmanager
def engine_in_own_group() -> Iterator[None]:
    """Processes spawned inside this block start in a new process group."""
    with _lock, tempfile.TemporaryDirectory(prefix="rlserve-launch-") as tmp:
        launcher = Path(tmp) / "python"
        launcher.write_text(_LAUNCHER.format(python=sys.executable))
        launcher.chmod(0o755)
        multiprocessing.set_executable(str(launcher))
        try:
            yield
        finally:
            multiprocessing.set_executable(sys.executable)


RPC_BASE_ENV = "VLLM_RPC_BASE_PATH"


class SocketDir:
    """Where one engine's processes put their Unix sockets: a directory only this user can
    enter (mkdtemp: mode 0700), removed by `remove()` with whatever the engine left in it. Its
    owner holds a lock on a file in it while it lives: a server killed outright leaves its
    directory behind, and the next one made on this host removes every such directory no
    process holds (the kernel drops a dead owner's lock). A VLLM_RPC_BASE_PATH someone set is
    theirs: then nothing is made or removed."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self._lock: int | None = None
        if RPC_BASE_ENV in os.environ:
            return
        remove_abandoned_socket_dirs()
        path = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX))
        if len(os.fsencode(path / VLLM_SOCKET_NAME)) > MAX_SOCKET_PATH:
            # A Unix socket's path has at most 107 bytes: vLLM's own place still fits.
            shutil.rmtree(path)
            logger.warning("the temp dir's path is too long for a socket directory of the engine's own: %s", path)
            return
        self.path = path
        self._lock = os.open(self.path / OWNER_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """vLLM names its sockets here inside this block, and the processes spawned in it do
        for as long as they run. A failure inside removes the directory."""
        if self.path is None:
            yield
            return
        os.environ[RPC_BASE_ENV] = str(self.path)
        try:
            yield
        except BaseException:
            self.remove()
            raise
        finally:
            os.environ.pop(RPC_BASE_ENV, None)

    def remove(self) -> None:
        """After the engine's processes have exited."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


SOCKET_DIR_PREFIX = "rlserve-engine-"
# sockaddr_un.sun_path holds 108 bytes with the terminating NUL; vLLM names a socket by a uuid.
MAX_SOCKET_PATH = 107
VLLM_SOCKET_NAME = "00000000-0000-0000-0000-000000000000"
OWNER_LOCK = ".owner"
# A directory younger than this may be one whose owner has not locked it yet.
ABANDONED_AFTER_S = 60.0


def remove_abandoned_socket_dirs() -> list[Path]:
    """Remove this user's engine socket directories in the temp dir that no process holds
    (their server was killed outright); returns them. A directory whose lock is held, that is
    younger than a minute, or that is not a plain directory of this user is left alone."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(SOCKET_DIR_PREFIX + "*"):
        try:
            st = os.lstat(path)
            if (
                not stat.S_ISDIR(st.st_mode)
                or st.st_uid != os.geteuid()
                or time.time() - st.st_mtime < ABANDONED_AFTER_S
            ):
                continue
            fd = os.open(path / OWNER_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its server lives
            os.close(fd)
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed
