"""Completion notices from inference workers to the server, over a Unix socket the server
owns: how a worker tells the server that a long operation (a rendezvous, receiving a chunk)
it runs in a thread of its own has ended, without blocking vLLM's engine loop meanwhile.

One JSON line per notice: {"op": id, "worker": rank, "reply": Reply.to_dict()}; the first line
of a connection is {"worker": rank}. The server side is asyncio, the worker side is a plain
blocking socket used from the worker's transfer threads.
"""

from __future__ import annotations

import asyncio
import json
import logging

from rlserve.engine.owned_dir import OwnedDir
from rlserve.wire.protocol import Reply

logger = logging.getLogger(__name__)

MAX_LINE_BYTES = 1 << 20
NOTIFY_DIR_PREFIX = "rlserve-notify-"


class WorkerGone(Exception):
    """A worker's connection closed while the server waited for its notice."""


class NotificationHub:
    """The server's end: one listening socket, a future per (operation, worker)."""

    def __init__(self) -> None:
        # Swept by a later server's start if this one is killed outright (125 were left here).
        self._dir = OwnedDir(NOTIFY_DIR_PREFIX)
        self.address = str(self._dir.path / "n.sock")
        self._server: asyncio.AbstractServer | None = None
        self._pending: dict[tuple[str, int], asyncio.Future[Reply]] = {}
        self._connected: set[int] = set()

    async def start(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_unix_server(self._serve, path=self.address, limit=MAX_LINE_BYTES)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._dir.remove()

    def expect(self, op: str, workers: range) -> list[asyncio.Future[Reply]]:
        """Futures for the notices of `op` from each worker; register before starting it."""
        loop = asyncio.get_running_loop()
        futures = []
        for worker in workers:
            future = loop.create_future()
            self._pending[(op, worker)] = future
            futures.append(future)
        return futures

    def forget(self, op: str, workers: range) -> None:
        for worker in workers:
            future = self._pending.pop((op, worker), None)
            if future is not None and not future.done():
                future.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        worker: int | None = None
        try:
            hello = json.loads(await reader.readline())
            worker = int(hello["worker"])
            self._connected.add(worker)
            while line := await reader.readline():
                notice = json.loads(line)
                future = self._pending.pop((str(notice["op"]), worker), None)
                if future is not None and not future.done():
                    future.set_result(Reply.from_dict(notice["reply"]))
        except (ValueError, KeyError, TypeError, OSError, asyncio.IncompleteReadError) as e:
            logger.warning("dropped a malformed worker notice connection: %s", e)
        finally:
            writer.close()
            if worker is not None:
                self._connected.discard(worker)
                self._fail_pending(worker)

    def _fail_pending(self, worker: int) -> None:
        for (op, w), future in list(self._pending.items()):
            if w == worker and not future.done():
                del self._pending[(op, w)]
                future.set_exception(WorkerGone(f"worker {worker} went away during {op}"))
