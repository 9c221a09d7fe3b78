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
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

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
