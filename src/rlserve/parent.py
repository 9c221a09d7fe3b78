"""The end of the process that started this one, one rule for every side: this process is then
re-parented, so its parent id changes. Polled, because Linux offers no portable notice to a
process that is not the parent's child reaper. Used by `rlserve serve --exit-with-parent` (on
its event loop) and by vLLM's own processes (`rlserve.worker.lifetime`, in a thread). Also
how a process ended, in words (`how_it_ended`)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

POLL_S = 0.5
# Set by a launcher (`rlserve.sdk.launch.ServerProcess`) to its own pid in the server's
# environment, and taken out of it by the server (`take_launcher_pid`).
LAUNCHER_PID_ENV = "RLSERVE_LAUNCHER_PID"


def take_launcher_pid() -> int:
    """The pid of the process that started this one, as that process said it: multiprocessing's
    parent, or the pid a launcher put in LAUNCHER_PID_ENV (removed here, so that what this
    process starts does not inherit it), else the parent id now. Asked only after seconds of
    imports, the parent id of a process whose launcher has died meanwhile is already init's,
    and a wait for it to change would never end."""
    named = os.environ.pop(LAUNCHER_PID_ENV, "")
    spawner = multiprocessing.parent_process()
    if spawner is not None and spawner.pid is not None:
        return spawner.pid
    return int(named) if named.isdigit() else os.getppid()


def is_gone(launcher: int) -> bool:
    """Whether `launcher` has exited. While it is this process's parent it has not; otherwise
    it has unless a process that has not exited still has its pid (a launcher that started
    this one through a wrapper, `nohup` or a shell, is still there)."""
    return os.getppid() != launcher and not _running(launcher)


def _running(pid: int) -> bool:
    """Whether a process that has not exited has this pid (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read()
    except OSError:
        return False
    state = fields[fields.rindex(b")") + 2 : fields.rindex(b")") + 3]  # after "pid (comm) "
    return state not in (b"Z", b"X")


def wait_for_parent_exit(parent: int, poll_s: float = POLL_S) -> None:
    """Blocks until process `parent` (this one's parent when it started) is gone."""
    while not is_gone(parent):
        time.sleep(poll_s)


async def parent_exited(parent: int, poll_s: float = POLL_S) -> None:
    """`wait_for_parent_exit` on an event loop."""
    while not is_gone(parent):
        await asyncio.sleep(poll_s)


def how_it_ended(code: int) -> str:
    """A process's exit code (multiprocessing's and subprocess's: negative for the signal
    that ended it) in words: "exit status 1", "signal SIGKILL"."""
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"
