"""Sleep/wake rules of the lifecycle controller.

vLLM has no sleep mode on the CPU platform, so a real engine cannot reach these states here;
`SleepCapableEngine` is a test double that records the calls the controller makes and
answers like vLLM's sleep mode (wake_up returns True once every tag is resident). The GPU
check script (benchmarks/gpu_check.py) runs the same sequence on a real CUDA engine.
"""

from __future__ import annotations

import asyncio

import pytest

from rlserve.engine.transport import TransportInit
from rlserve.errors import CapabilityMissing, InvalidRequest, MemoryAsleep, WeightsInconsistent, WrongState
from rlserve.lifecycle.controller import LifecycleController
from rlserve.types import PauseMode, PausePhase, RlCapabilities, SleepTag


class _Monitor:
    def on_dead(self, listener) -> None:
        pass

    def check_alive(self) -> None:
        pass


class SleepCapableEngine:
    """Test double: just the engine-adapter calls the controller makes for sleep and wake."""

    transport = None
    monitor = _Monitor()
    weight_dtype = "float32"
    weight_bytes = 0
    logprobs_mode = "raw_logprobs"
    max_loaded_loras = 0

    def __init__(self, *, sleep_mode: bool = True) -> None:
        self.calls: list[tuple] = []
        self._sleep_mode = sleep_mode
        self._asleep: set[str] = set()

    def capabilities(self) -> RlCapabilities:
        return RlCapabilities(False, "", self._sleep_mode, False)

    async def sleep(self, level: int, mode: PauseMode) -> None:
        self.calls.append(("sleep", level, mode))
        if level >= 1:
            self._asleep = {"weights", "kv_cache"}

    async def wake_up(self, tags: list[str] | None) -> bool:
        self.calls.append(("wake_up", tags))
        self._asleep -= set(tags) if tags is not None else set(self._asleep)
        return not self._asleep

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        self.calls.append(("pause", mode))

    async def resume(self) -> None:
        self.calls.append(("resume",))

    async def engine_statuses(self) -> list:
        return []


def controller(engine: SleepCapableEngine) -> LifecycleController:
    return LifecycleController(engine, max_held_requests=8, initial_version="default")  # type: ignore[arg-type]  # a partial fake


async def test_level_1_sleep_refuses_resume_until_fully_awake():
    engine = SleepCapableEngine()
    c = controller(engine)
    await c.sleep(1, PauseMode.ABORT)
    assert c.state.is_sleeping and c.state.is_paused and c.state.sleep_level == 1
    with pytest.raises(MemoryAsleep, match="WakeUp"):
        await c.resume()
    await c.wake_up(frozenset({SleepTag.WEIGHTS}))
    assert c.state.asleep == frozenset({SleepTag.KV_CACHE}) and c.state.is_paused
    await c.wake_up(frozenset({SleepTag.KV_CACHE}))
    assert not c.state.is_sleeping
    assert c.state.pause_phase is PausePhase.RUNNING, "a full wake with intact weights resumes, as upstream"
    assert engine.calls == [("sleep", 1, PauseMode.ABORT), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]


async def test_level_2_sleep_keeps_generation_paused_until_new_weights():
    engine = SleepCapableEngine()
    c = controller(engine)
    await c.sleep(2, PauseMode.WAIT)
    assert not c.state.weights_consistent
    await c.wake_up(frozenset())
    assert not c.state.is_sleeping and c.state.is_paused
    assert engine.calls[-1] == ("pause", PauseMode.KEEP), "vLLM's scheduler must be re-paused after the wake"
    with pytest.raises(WeightsInconsistent, match="weight update"):
        await c.resume()


async def test_sleep_rules():
    c = controller(SleepCapableEngine())
    with pytest.raises(InvalidRequest, match="level"):
        await c.sleep(3, PauseMode.ABORT)
    with pytest.raises(InvalidRequest, match="kept requests"):
        await c.sleep(2, PauseMode.KEEP)
    assert not c.state.is_paused, "refused calls change nothing"
    await c.sleep(1, PauseMode.KEEP)
    revision = c.state.revision
    await c.sleep(1, PauseMode.KEEP)
    assert c.state.revision == revision, "sleeping again at the same level is a no-op"
    assert [a.outcome for a in (await c.snapshot()).recent_mutations][-1] == "noop"


async def test_without_sleep_mode_everything_fails_closed():
    engine = SleepCapableEngine(sleep_mode=False)
    c = controller(engine)
    for call in (c.sleep(1, PauseMode.ABORT), c.wake_up(frozenset())):
        with pytest.raises(CapabilityMissing):
            await call
    assert engine.calls == [] and not c.state.is_paused


class StagingTransport:
    """Test double: a backend that stages updates and answers every call at once."""

    backend = "fake"
    stages_updates = True

    def parse_init(self, raw, max_timeout_s: float) -> TransportInit:
        return TransportInit(max_timeout_s, "fake", {})

    async def init(self, init: TransportInit) -> None:
        pass

    async def start(self, is_draft: bool, timeout_s: float) -> None:
        pass

    async def abort(self, timeout_s: float) -> None:
        pass


async def test_a_refused_sleep_leaves_the_open_sessions_lease_armed():
    """Sleep with a staged session open is refused; the session's lease must still drop it
    when its trainer is gone (the refusal used to disarm the lease first: the session then
    stayed open for ever)."""
    engine = SleepCapableEngine()
    engine.transport = StagingTransport()  # type: ignore[assignment]
    c = LifecycleController(engine, max_held_requests=8, initial_version="default", lease_s=0.2)  # type: ignore[arg-type]  # a partial fake
    await c.weights.init(b"{}")
    await c.weights.start(staged=True)
    assert c.state.update_session is not None and not c.state.is_paused
    with pytest.raises(WrongState, match="weight update is open"):
        await c.sleep(1, PauseMode.ABORT)
    await asyncio.sleep(0.5)
    assert c.state.update_session is None, "the lease dropped the session"
    assert not c.state.is_paused and ("sleep", 1, PauseMode.ABORT) not in engine.calls
