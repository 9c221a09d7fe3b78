"""The leading frontend's end of the other frontend processes: it listens on a local socket,
hands each the credentials in force (and every reload), admits each of their requests through
the one lifecycle controller (so a pause holds them and counts them, and Abort reaches them),
forwards aborts, tells them whether inference serves, keeps the newest scheduler figures any
of them received, and ends in the engine whatever a frontend that is gone left running there
(told so by its process's exit, or by its stream's end, whichever comes first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from rlserve.errors import RlserveError
from rlserve.frontends import protocol as p
from rlserve.lifecycle.controller import LifecycleController
from rlserve.lifecycle.state import LifecycleState
from rlserve.types import EngineLoad, FrontendStatus

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    """One request of a following frontend, from Admit to Ended: `task` holds its place."""

    task: asyncio.Task[None] | None = None
    entered: asyncio.Future[str] = field(default_factory=asyncio.Future)  # its internal id
    internal_id: str = ""


class _Follower:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.index = -1  # known from Hello
        self.pid = 0
        self.is_ready = False  # serving the inference port (Ready)
        self.is_gone = False
        self.requests: dict[int, _Request] = {}
        self.num_requests = 0

    def send(self, message: p.Message) -> None:
        if not self.writer.is_closing():
            self.writer.write(p.frame(message))


class FrontendHub:
    """`abort_internal(ids)` aborts requests by vLLM's internal ids in the engine whichever
    frontend submitted them (those of a frontend that is gone); `serving(state)` says whether
    inference serves; `observe_rpc` counts the other frontends' RPCs with this one's;
    `merge_load` keeps the scheduler figures they received; `tokens_text()` is the credentials
    in force; `num_restarts(index)` how often frontend `index` was restarted, of
    `num_frontends` in all."""

    def __init__(
        self,
        lifecycle: LifecycleController,
        path: str,
        abort_internal: Callable[[list[str]], Awaitable[None]],
        serving: Callable[[LifecycleState], bool],
        observe_rpc: Callable[[str, str, float], None],
        merge_load: Callable[[EngineLoad], None],
        tokens_text: Callable[[], str | None],
        num_restarts: Callable[[int], int],
        num_frontends: int,
    ) -> None:
        self._lifecycle = lifecycle
        self._path = path
        self._abort_internal = abort_internal
        self._serving = serving
        self._observe_rpc = observe_rpc
        self._merge_load = merge_load
        self._tokens_text = tokens_text
        self._num_restarts = num_restarts
        self._followers: set[_Follower] = set()
        self._server: asyncio.AbstractServer | None = None
        self._watch: asyncio.Task[None] | None = None
        self.on_ready: Callable[[int], None] = lambda index: None
        lifecycle.attach_frontends(self._forward_abort, self._statuses, num_frontends)

    def ready_indexes(self) -> set[int]:
        """The frontends that serve the inference port now."""
        return {f.index for f in self._followers if f.is_ready}

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, self._path, limit=p.MAX_FRAME_BYTES)
        os.chmod(self._path, 0o600)
        self._watch = asyncio.ensure_future(self._follow_state())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._server is not None:
            self._server.close()
        for follower in list(self._followers):
            follower.writer.close()

    async def _follow_state(self) -> None:
        serving = None
        async for state in self._lifecycle.watch():
            now = self._serving(state)
            if now != serving:
                serving = now
                for follower in self._followers:
                    follower.send(p.Serving(now))

    def push_credentials(self) -> None:
        """The credentials in force changed (a reload): every frontend takes them now."""
        message = p.Credentials(self._tokens_text())
        for follower in self._followers:
            follower.send(message)

    def _statuses(self) -> tuple[FrontendStatus, ...]:
        ready = sorted((f for f in self._followers if f.is_ready), key=lambda f: f.index)
        return tuple(
            FrontendStatus(f.index, f.pid, f.num_requests, len(f.requests), self._num_restarts(f.index)) for f in ready
        )

    def _forward_abort(self, request_ids: list[str]) -> None:
        for follower in self._followers:
            follower.send(p.AbortRequests(tuple(request_ids)))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        follower = _Follower(writer)
        self._followers.add(follower)
        try:
            while (message := await p.read_message(reader)) is not None:
                self._dispatch(follower, message)
        finally:
            await self._lost(follower)

    async def process_gone(self, index: int, pid: int) -> None:
        """Frontend `index`'s process `pid` exited (its sentinel said so): whatever its stream
        still says (another process may hold the socket open), it is gone."""
        for follower in [f for f in self._followers if f.index == index and f.pid == pid]:
            await self._lost(follower)

    def _dispatch(self, follower: _Follower, message: p.Message) -> None:
        if isinstance(message, p.Admit):
            follower.num_requests += 1
            request = follower.requests[message.seq] = _Request()
            request.task = asyncio.ensure_future(self._admit(follower, message, request))
        elif isinstance(message, p.Entered):
            entering = follower.requests.get(message.seq)
            if entering is not None and not entering.entered.done():
                entering.entered.set_result(message.internal_id)
        elif isinstance(message, p.Ended):
            # Over, wherever it was: held, on its way in, or done in the engine.
            ended = follower.requests.pop(message.seq, None)
            if ended is not None and ended.task is not None:
                ended.task.cancel()
        elif isinstance(message, p.ListLoras):
            follower.send(p.Loras(message.seq, self._lifecycle.loras.adapters()))
        elif isinstance(message, p.Observed):
            self._observe_rpc(message.method, message.code, message.seconds)
        elif isinstance(message, p.Record):
            self._lifecycle.record(message.operation, f"{message.detail} (frontend {follower.index})", message.outcome)
        elif isinstance(message, p.Load):
            self._merge_load(
                EngineLoad(
                    message.data_parallel_rank,
                    message.num_running_requests,
                    message.num_waiting_requests,
                    message.kv_cache_usage,
                    message.unix_time_s,
                )
            )
        elif isinstance(message, p.Hello):
            follower.index, follower.pid = message.index, message.pid
            follower.send(p.Credentials(self._tokens_text()))
            follower.send(p.Serving(self._serving(self._lifecycle.state)))
        elif isinstance(message, p.Ready):
            follower.is_ready = True
            logger.info("frontend %d (pid %d) serves", follower.index, follower.pid)
            self.on_ready(follower.index)

    async def _admit(self, follower: _Follower, message: p.Admit, request: _Request) -> None:
        """Holds the request's place at the gate (and its adapter) until Ended cancels it."""
        try:
            async with self._lifecycle.admission(message.request_id, message.num_bytes, message.lora_name) as admission:
                follower.send(p.Admitted(message.seq, admission.aborted, admission.lora))
                if admission.aborted:
                    return
                request.internal_id = await request.entered
                if admission.entered() and request.internal_id:
                    follower.send(p.AbortRequests((message.request_id,)))
                await asyncio.Future()  # until Ended
        except RlserveError as e:
            follower.requests.pop(message.seq, None)
            follower.send(p.refusal(message.seq, e))
        except Exception as e:  # a bug here: the request must still get its answer
            logger.exception("admitting request %r of frontend %d failed", message.request_id, follower.index)
            follower.requests.pop(message.seq, None)
            follower.send(p.Refused(message.seq, RlserveError.kind, f"admission failed: {type(e).__name__}: {e}"))

    async def _lost(self, follower: _Follower) -> None:
        """A frontend that went away (it exited, or was killed): what it had in the engine is
        aborted there, its held requests leave the gate, its adapters are unpinned, and then
        it leaves GetState (so a state without it is one where its aborts were sent)."""
        if follower.is_gone:
            return
        follower.is_gone = True
        running = [r.internal_id for r in follower.requests.values() if r.internal_id]
        for request in follower.requests.values():
            if request.task is not None:
                request.task.cancel()
        follower.requests.clear()
        follower.writer.close()
        if follower.index >= 0:
            logger.warning(
                "frontend %d (pid %d) is gone; aborting its %d requests in the engine",
                follower.index,
                follower.pid,
                len(running),
            )
        try:
            if running:
                with contextlib.suppress(RlserveError):
                    await self._abort_internal(running)
        finally:
            self._followers.discard(follower)
