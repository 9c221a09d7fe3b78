"""`rlserve.worker.lifetime`, the vLLM plugin every engine process loads, in processes of the
kind vLLM starts (multiprocessing, spawned) but without an engine: at exit, such a process
freezes its heap before the interpreter's last garbage collection, which otherwise walked all
of torch and vLLM and kept an engine core past the 5 s vLLM gives it before SIGKILL."""

from __future__ import annotations

import atexit
import gc
import multiprocessing
from pathlib import Path

import pytest


def _exit_after_registering(out: str, register: bool) -> None:
    # atexit runs the last registered first: this probe runs after whatever register() added.
    atexit.register(lambda: Path(out).write_text(str(gc.get_freeze_count())))
    gc.unfreeze()  # as vLLM's engine core leaves its heap when it shuts down
    if register:
        from rlserve.worker import lifetime

        lifetime.register()


@pytest.mark.parametrize("register", [True, False], ids=["plugin", "without"])
def test_a_spawned_process_freezes_its_heap_before_the_last_collection_of_its_exit(tmp_path, register):
    out = tmp_path / "frozen"
    process = multiprocessing.get_context("spawn").Process(target=_exit_after_registering, args=(str(out), register))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    frozen = int(out.read_text())
    # Without the plugin nothing is frozen, so the probe can tell the difference.
    assert (frozen > 1000) if register else (frozen == 0), frozen
