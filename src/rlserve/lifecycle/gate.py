"""Admission of generation requests into the engine.

While generation is paused the gate holds validated requests (bounded by count and by an
estimate of their bytes) and lets them go on resume; Abort ends held ones at once. It also
counts the requests on their way into the engine, so that a pause can wait for them to
arrive there instead of overtaking them: a request is either held, or known to the engine
before the pause reaches it. No engine, no grpc.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rlserve.errors import Overloaded, TooManyHeldRequests
from rlserve.types import LoraAdapter


@dataclass(eq=False)
class Ticket:
    """One request at the gate, from admission until the engine has it."""

    request_id: str
    num_bytes: int
    aborted: bool = False
    error: Exception | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class Admission:
    """A request another frontend process admitted through this gate (see
    `LifecycleController.admission`)."""

    ticket: Ticket
    lora: LoraAdapter | None
    _gate: GenerationGate
    aborted: bool = False
    _is_entered: bool = False

    def entered(self) -> bool:
        """The engine has it now (or refused it); True when Abort named it on its way in,
        so it must be aborted in the engine. Once only; later calls return False."""
        if self._is_entered or self.aborted:
            return False
        self._is_entered = True
        self._gate.entered(self.ticket)
        return self.ticket.aborted


class GenerationGate:
    def __init__(self, *, max_held: int, max_held_bytes: int, on_held: Callable[[int], None]) -> None:
        self._max_held, self._max_held_bytes = max_held, max_held_bytes
        self._on_held = on_held
        self._is_open = True
        self._held: set[Ticket] = set()
        self._held_bytes = 0
        self._entering: set[Ticket] = set()
        self._entered = asyncio.Event()
        self._entered.set()
        self._failure: Exception | None = None

    @property
    def num_held(self) -> int:
        return len(self._held)

    def close(self) -> None:
        """From now on requests are held."""
        self._is_open = False

    def open(self) -> None:
        self._is_open = True
        for ticket in self._held:
            ticket._wake.set()

    async def admit(self, ticket: Ticket) -> bool:
        """Wait while the gate is closed; False when the request was aborted meanwhile (it
        never reaches the engine). A held request that is cancelled (deadline, client gone)
        simply leaves. Raises TooManyHeldRequests / Overloaded at the caps."""
        if self._failure is not None:
            raise self._failure
        if not self._is_open:
            await self._hold(ticket)
            if ticket.error is not None:
                raise ticket.error
            if ticket.aborted:
                return False
        self._entering.add(ticket)
        self._entered.clear()
        return True

    def entered(self, ticket: Ticket) -> None:
        """The engine has the request now (or refused it)."""
        self._entering.discard(ticket)
        if not self._entering:
            self._entered.set()

    async def wait_entered(self) -> None:
        """Until every admitted request has reached the engine (an instant, not a drain)."""
        await self._entered.wait()

    def fail_all(self, error: Exception) -> None:
        """Every held request ends with `error` (the engine died: resume will never come),
        and so does every later one."""
        self._failure = error
        for ticket in self._held:
            ticket.error = error
            ticket._wake.set()

    def abort_all(self) -> None:
        """Every held request and every one on its way in ends without running (shutdown)."""
        for ticket in (*self._held, *self._entering):
            ticket.aborted = True
            ticket._wake.set()

    def abort(self, request_ids: Iterable[str]) -> None:
        """Held requests with these ids end without running; ones on their way in are
        marked, and their caller aborts them in the engine once they arrive."""
        ids = set(request_ids)
        for ticket in (*self._held, *self._entering):
            if ticket.request_id in ids:
                ticket.aborted = True
                ticket._wake.set()

    async def _hold(self, ticket: Ticket) -> None:
        if len(self._held) >= self._max_held:
            raise TooManyHeldRequests(self._max_held)
        if self._held_bytes + ticket.num_bytes > self._max_held_bytes:
            raise Overloaded(
                f"generation is paused and the held requests already use about {self._held_bytes} bytes "
                f"(max_held_bytes={self._max_held_bytes}); retry after resume"
            )
        self._held.add(ticket)
        self._held_bytes += ticket.num_bytes
        self._on_held(len(self._held))
        try:
            while not self._is_open and not ticket.aborted and ticket.error is None:
                ticket._wake.clear()
                await ticket._wake.wait()
        finally:
            self._held.discard(ticket)
            self._held_bytes -= ticket.num_bytes
            self._on_held(len(self._held))
