"""State edits: `StateOwner.publish(edit)` applies a named transition to the state as it is
when published (so an edit made after an await cannot undo a change published meanwhile),
as one change with the next revision; chained transitions are one change."""

from __future__ import annotations

from rlserve.lifecycle.owner import StateOwner
from rlserve.lifecycle.state import LifecycleState, UpdateSession
from rlserve.types import MEMORY_TAGS, PauseMode, PausePhase


async def test_an_edit_applies_to_the_state_as_it_is_when_published():
    owner = StateOwner("v0")
    session = UpdateSession("s", False, 0.0)
    owner.publish(lambda s: s.paused_as(PausePhase.PAUSED, PauseMode.KEEP).in_session(session))
    before = owner.state
    # A mutation that read the state, then awaited while held requests were counted:
    owner.publish(lambda s: s.holding(3))
    owner.publish(lambda s: s.in_session(None).mark_inconsistent("the commit failed half way"))
    state = owner.state
    assert state.num_held_requests == 3  # not undone by the later edit
    assert state.update_session is None and not state.weights_consistent
    assert state.inconsistency_reason == "the commit failed half way"
    assert state.pause_phase is PausePhase.PAUSED and state.pause_mode is PauseMode.KEEP
    assert state.revision == before.revision + 2


async def test_each_publish_is_one_change_seen_by_observers():
    seen: list[tuple[int, int]] = []

    class Watch:
        def published(self, before: LifecycleState, after: LifecycleState) -> None:
            seen.append((before.revision, after.revision))

        def recorded(self, entry) -> None:
            pass

    owner = StateOwner("v0")
    owner.observe(Watch())
    owner.publish(lambda s: s.slept(2))
    assert seen == [(0, 0), (0, 1)]
    state = owner.state
    assert state.asleep == MEMORY_TAGS and state.sleep_level == 2 and state.pause_phase is PausePhase.PAUSED
    assert not state.weights_consistent and "level-2 sleep" in state.inconsistency_reason
    owner.publish(lambda s: s.sleeping(frozenset(), 0).consistent().running())
    assert owner.state.is_paused is False and owner.state.weights_consistent and seen[-1] == (1, 2)


def test_transport_transitions_keep_what_they_are_not_told():
    state = LifecycleState().transport(ready=True)
    assert state.transport(initializing=True).transport_ready is True
    assert state.transport(initializing=True).transport(initializing=False).transport_ready is True
    assert state.transport(ready=False).transport_initializing is False
