"""The idle lease on a pause a trainer holds for a weight update. Every update call re-arms it
(with its session, or with none after a failed update left generation paused); whoever decides
about the pause (pause, resume, sleep, a new start) disarms it. It belongs to the owner of the
pause, the lifecycle controller: when it runs out, the controller's `on_expired(session_id,
token)` aborts the session and resumes generation on intact weights. No grpc, no engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class SessionLease:
    def __init__(self, lease_s: float, on_expired: Callable[[str | None, int], Awaitable[None]]) -> None:
        self.lease_s = lease_s
        self._on_expired = on_expired
        self._timer: asyncio.TimerHandle | None = None
        self._token = 0
        self._expiry: asyncio.Task[None] | None = None

    def arm(self, session_id: str | None) -> None:
        """With a session: the session's lease. Without: the lease of the pause a failed
        update left behind."""
        self.disarm()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.lease_s, self._fired, session_id, self._token)

    def disarm(self) -> None:
        # A lease that already fired and waits for the lock is stale from now on.
        self._token += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def is_current(self, token: int) -> bool:
        """Whether the lease that fired with `token` is still the armed one (asked under the
        owner's lock, after it was taken)."""
        return token == self._token

    def _fired(self, session_id: str | None, token: int) -> None:
        self._expiry = asyncio.ensure_future(self._on_expired(session_id, token))
