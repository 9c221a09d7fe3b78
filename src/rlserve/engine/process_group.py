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
import logging
import multiprocessing
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from rlserve.engine.owned_dir import OwnedDir

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
SOCKET_DIR_PREFIX = "rlserve-engine-"
# sockaddr_un.sun_path holds 108 bytes with the terminating NUL; vLLM names a socket by a uuid.
MAX_SOCKET_PATH = 107
VLLM_SOCKET_NAME = "00000000-0000-0000-0000-000000000000"


class SocketDir:
    """Where one engine's processes put their Unix sockets: an `OwnedDir` (mode 0700, swept
    by the next server's start if its server was killed outright), removed by `remove()`
    with whatever the engine left in it. A VLLM_RPC_BASE_PATH someone set is theirs: then
    nothing is made or removed."""

    def __init__(self) -> None:
        self._dir: OwnedDir | None = None
        if RPC_BASE_ENV in os.environ:
            return
        owned = OwnedDir(SOCKET_DIR_PREFIX)
        if len(os.fsencode(owned.path / VLLM_SOCKET_NAME)) > MAX_SOCKET_PATH:
            # A Unix socket's path has at most 107 bytes: vLLM's own place still fits.
            owned.remove()
            logger.warning("the temp dir's path is too long for a socket directory of the engine's own: %s", owned.path)
            return
        self._dir = owned

    @property
    def path(self) -> Path | None:
        return None if self._dir is None else self._dir.path

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """vLLM names its sockets here inside this block, and the processes spawned in it do
        for as long as they run. A failure inside removes the directory."""
        if self._dir is None:
            yield
            return
        os.environ[RPC_BASE_ENV] = str(self._dir.path)
        try:
            yield
        except BaseException:
            self.remove()
            raise
        finally:
            os.environ.pop(RPC_BASE_ENV, None)

    def remove(self) -> None:
        """After the engine's processes have exited."""
        if self._dir is not None:
            self._dir.remove()
