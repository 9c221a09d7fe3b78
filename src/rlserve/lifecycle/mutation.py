"""Shared by every lifecycle mutation: it runs to its end even if its caller goes away."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def survives_caller_cancellation(
    method: Callable[..., Coroutine[Any, Any, T]],
) -> Callable[..., Coroutine[Any, Any, T]]:
    """A mutation runs to its end (bounded by its own deadlines) even if the RPC that asked
    for it is cancelled, e.g. because the trainer died: a half-applied transition would
    leave the state and the engine disagreeing."""

    @functools.wraps(method)
    async def wrapper(self: Any, *args: Any, **kwargs: Any) -> T:
        task = asyncio.ensure_future(method(self, *args, **kwargs))
        # If nobody awaits the result any more, still consume its exception (it is audited).
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(task)

    return wrapper
