"""The end of the process that started this one, one rule for every side: this process is then
re-parented, so its parent id changes. Polled, because Linux offers no portable notice to a
process that is not the parent's child reaper. Used by `rlserve serve --exit-with-parent` (on
its event loop) and by vLLM's own processes (`rlserve.worker.lifetime`, in a thread). Also
how a process ended, in words (`how_it_ended`)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

POLL_S = 0.5


def wait_for_parent_exit(parent: int, poll_s: float = POLL_S) -> None:
    """Blocks until process `parent` (this one's parent when it started) is gone."""
    while os.getppid() == parent:
        time.sleep(poll_s)


async def parent_exited(parent: int, poll_s: float = POLL_S) -> None:
    """`wait_for_parent_exit` on an event loop."""
    while os.getppid() == parent:
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
