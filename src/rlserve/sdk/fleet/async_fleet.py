"""`AsyncFleet`: the asyncio twin of `Fleet`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlserve.sdk.client import Client
from rlserve.sdk.fleet.fleet import Fleet
from rlserve.sdk.fleet.members import Dropped, FleetSyncStats
from rlserve.sdk.fleet.routing import Routed
from rlserve.sdk.plan import NamedTensors


class AsyncFleet:
    """The asyncio twin of `Fleet`, over the same machinery: its blocking calls run in worker
    threads of its own, so the trainer's event loop goes on (rollouts included) while a sync
    runs. `servers` and the arguments as `Fleet`'s, or a `Fleet` to drive (not closed here)."""

    def __init__(self, servers: Fleet | Iterable[str | Client], *, max_concurrency: int = 256, **kw: Any) -> None:
        """`max_concurrency`: requests in flight at once (each holds a thread)."""
        self._owned = not isinstance(servers, Fleet)
        self.fleet = Fleet(servers, **kw) if not isinstance(servers, Fleet) else servers
        self._threads = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="rlserve-async-fleet")

    async def _in_thread(self, call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._threads, lambda: call(*args, **kw))

    @property
    def servers(self) -> tuple[str, ...]:
        return self.fleet.servers

    @property
    def dropped(self) -> list[Dropped]:
        return self.fleet.dropped

    def add(self, server: str | Client) -> str:
        return self.fleet.add(server)

    def remove(self, server: str) -> None:
        self.fleet.remove(server)

    async def init(self, *, require_same_weights: bool = True) -> None:
        await self._in_thread(self.fleet.init, require_same_weights=require_same_weights)

    async def sync(self, weights: NamedTensors, version: str, **kw: Any) -> FleetSyncStats:
        return await self._in_thread(self.fleet.sync, weights, version, **kw)

    async def generate(self, prompt: Any, **kw: Any) -> Routed:
        return await self._in_thread(self.fleet.router.generate, prompt, **kw)

    async def generate_many(self, prompts: Sequence[Any], **kw: Any) -> list[Routed | BaseException]:
        return await self._in_thread(self.fleet.router.generate_many, prompts, **kw)

    async def stream(self, prompt: Any, **kw: Any) -> AsyncIterator[Routed]:
        """Each response as it arrives; leaving the loop early cancels the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stop = threading.Event()

        def pump() -> None:
            responses = self.fleet.router.stream(prompt, **kw)
            try:
                for routed in responses:
                    loop.call_soon_threadsafe(queue.put_nowait, routed)
                    if stop.is_set():
                        break
            except BaseException as e:  # handed to the consumer
                loop.call_soon_threadsafe(queue.put_nowait, e)
            finally:
                responses.close()  # cancels the call when it was left early
                loop.call_soon_threadsafe(queue.put_nowait, _END)

        pumping = asyncio.ensure_future(self._in_thread(pump))
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            await pumping

    async def close(self) -> None:
        if self._owned:
            await self._in_thread(self.fleet.close)
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> AsyncFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


_END = object()
