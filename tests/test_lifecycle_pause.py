"""Pause rules of the lifecycle controller, on a fake engine whose WAIT drain the test ends
when it wants: a real engine drains in milliseconds here, too fast to hold the controller in
the middle of one. (The same rules against a real engine: test_pause_modes.py.)"""

from __future__ import annotations

import asyncio

import pytest

from rlserve.errors import PauseDraining
from rlserve.lifecycle.controller import LifecycleController
from rlserve.types import PauseMode, PausePhase, RlCapabilities

from helpers import eventually


class _Monitor:
    def on_dead(self, listener) -> None:
        pass

    def check_alive(self) -> None:
        pass


class DrainingEngine:
    """Test double: records the controller's engine calls; a WAIT pause and the kept requests'
    end (KEEP -> WAIT) last until the test sets `drained`."""

    transport = None
    load = None
    monitor = _Monitor()
    weight_dtype = "float32"
    weight_bytes = 0
    logprobs_mode = "raw_logprobs"
    max_loaded_loras = 0

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.drained = asyncio.Event()

    def capabilities(self) -> RlCapabilities:
        return RlCapabilities(False, "", False, False)

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        self.calls.append(("pause", mode))
        if mode is PauseMode.WAIT:
            await self.drained.wait()

    async def resume(self) -> None:
        self.calls.append(("resume",))

    async def requests_done(self) -> None:
        self.calls.append(("requests_done",))
        await self.drained.wait()

    async def engine_statuses(self) -> list:
        return []


def controller(engine: DrainingEngine) -> LifecycleController:
    return LifecycleController(engine, max_held_requests=8, initial_version="v0")  # type: ignore[arg-type]  # a partial fake


async def test_a_wait_pause_is_pausing_until_the_engine_drained_and_resume_is_refused_meanwhile():
    engine = DrainingEngine()
    c = controller(engine)
    pausing = asyncio.ensure_future(c.pause(PauseMode.WAIT, clear_cache=False))
    await eventually(lambda: ("pause", PauseMode.WAIT) in engine.calls, timeout_s=5.0, interval_s=0.001)
    assert c.state.pause_phase is PausePhase.PAUSING and c.state.pause_mode is PauseMode.WAIT
    with pytest.raises(PauseDraining):
        await c.resume()
    assert not pausing.done()
    engine.drained.set()
    await pausing
    assert c.state.pause_phase is PausePhase.PAUSED
    await c.resume()
    assert c.state.pause_phase is PausePhase.RUNNING and engine.calls[-1] == ("resume",)


async def test_a_stronger_pause_does_not_wait_behind_a_wait_drain():
    engine = DrainingEngine()
    c = controller(engine)
    waiting = asyncio.ensure_future(c.pause(PauseMode.WAIT, clear_cache=False))
    await eventually(lambda: c.state.pause_phase is PausePhase.PAUSING, timeout_s=5.0, interval_s=0.001)
    await asyncio.wait_for(c.pause(PauseMode.ABORT, clear_cache=True), timeout=5)
    assert ("pause", PauseMode.ABORT) in engine.calls
    assert c.state.pause_phase is PausePhase.PAUSED and c.state.pause_mode is PauseMode.ABORT
    engine.drained.set()
    await waiting  # the WAIT caller returns once paused, whichever pause got there
    assert c.state.pause_phase is PausePhase.PAUSED and c.state.pause_mode is PauseMode.ABORT


async def test_a_pause_no_stronger_than_the_one_held_changes_nothing():
    engine = DrainingEngine()
    c = controller(engine)
    await c.pause(PauseMode.ABORT, clear_cache=True)
    revision, calls = c.state.revision, list(engine.calls)
    for mode in (PauseMode.ABORT, PauseMode.WAIT, PauseMode.KEEP):
        await c.pause(mode, clear_cache=True)
    assert c.state.revision == revision and engine.calls == calls
    assert c.state.pause_mode is PauseMode.ABORT


async def test_keep_then_wait_runs_the_kept_requests_to_their_end_then_pauses():
    engine = DrainingEngine()
    c = controller(engine)
    await c.pause(PauseMode.KEEP, clear_cache=False)
    assert engine.calls == [("pause", PauseMode.KEEP)]
    waiting = asyncio.ensure_future(c.pause(PauseMode.WAIT, clear_cache=False))
    await eventually(lambda: ("requests_done",) in engine.calls, timeout_s=5.0, interval_s=0.001)
    # The engine runs again (new requests stay held at the gate) while the kept ones finish.
    assert engine.calls[1:] == [("resume",), ("requests_done",)]
    assert c.state.pause_phase is PausePhase.PAUSING
    engine.drained.set()
    await waiting
    assert engine.calls[-1] == ("pause", PauseMode.WAIT)
    assert c.state.pause_phase is PausePhase.PAUSED and c.state.pause_mode is PauseMode.WAIT
