"""vLLM general plugin (entry point `vllm.general_plugins`): a vLLM process that
multiprocessing started (the engine core, its workers) ends when the process that started it
ends, however that one ended, and ends promptly once it is told to.

vLLM's workers watch their engine core (a pipe), but the engine core does not watch the
frontend: a frontend killed with SIGKILL (an OOM kill, a Ray actor torn down, `kill -9`)
leaves the engine core and its workers running, holding the model's memory and cores, with
nothing left to talk to. Here each such process watches its parent (`rlserve.parent`); once
that is gone, the process is sent SIGTERM, which vLLM handles as a shutdown (its workers follow through their pipe), and
SIGKILL if it is still there `GRACE_S` later.

Told to stop, vLLM's frontend sends its engine core SIGTERM and SIGKILLs it 5 s later. The
engine core's teardown took 2.5-3 s on a 2-core AVX2 CPU, and then its interpreter's last
garbage collection walked every object it still held, the whole of torch and vLLM (vLLM
unfreezes its start-up heap as it shuts down), to about those 5 s: an engine in the tests'
process was SIGKILLed ("force killing remaining process EngineCore"), one under `rlserve
serve` got out just before, and every shutdown took about 5 s. At exit these processes now
freeze what they hold first, so that collection has nothing to walk (the memory goes back
with the process): a shutdown takes 1.4 s there.
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import os
import signal
import threading
import time

from rlserve.parent import take_launcher_pid, wait_for_parent_exit

logger = logging.getLogger(__name__)

GRACE_S = 10.0
_started = threading.Event()


def register() -> None:
    # The frontend (a process nothing spawned) keeps its own lifetime: `rlserve serve`
    # has --exit-with-parent for launchers that want it.
    if multiprocessing.parent_process() is None or _started.is_set():
        return
    _started.set()
    atexit.register(gc.freeze)
    threading.Thread(
        target=_exit_with_parent, args=(take_launcher_pid(),), name="rlserve-exit-with-parent", daemon=True
    ).start()


def _exit_with_parent(parent: int) -> None:
    wait_for_parent_exit(parent)
    logger.warning("process %d that started this one (%d) is gone: shutting down", parent, os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)
