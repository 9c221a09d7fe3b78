"""A following frontend's lifecycle: generation on its own engine client, admitted by the
leading frontend (the one lifecycle controller), so a pause holds its requests too and Abort
by id reaches them. It owns no lifecycle state and no credentials: it learns whether inference
serves and which tokens are in force from the leader, and passes the scheduler figures the
engine sent it on to the leader. When the leader is gone every held request ends UNAVAILABLE
and `lost` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from rlserve.errors import EngineUnavailable, InvalidRequest
from rlserve.frontends import protocol as p
from rlserve.lifecycle.lora_adapters import stamp_lora_version
from rlserve.types import EngineLoad, GenerateChunk, GenerateParams, LoraAdapter

if TYPE_CHECKING:
    from rlserve.engine.adapter import EngineAdapter

LEADER_GONE = "the server's leading frontend is gone; restart the server"


class LeaderLink:
    """The connection to the leader: one stream, every request's messages tagged by `seq`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._seqs = itertools.count()
        self._replies: dict[int, asyncio.Future[p.Message]] = {}
        self._admitting: set[int] = set()  # seqs waiting for admission
        self.is_serving = False
        self.on_serving: Callable[[bool], None] = lambda is_serving: None
        self.on_abort: Callable[[p.AbortRequests], None] = lambda message: None
        self.on_credentials: Callable[[str | None], None] = lambda tokens_text: None
        self._credentials: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.lost = asyncio.Event()
        self._reading: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, path: str, index: int) -> LeaderLink:
        reader, writer = await asyncio.open_unix_connection(path, limit=p.MAX_FRAME_BYTES)
        link = cls(reader, writer)
        link._send(p.Hello(index, os.getpid()))
        link._reading = asyncio.ensure_future(link._read())
        return link

    async def credentials(self) -> str | None:
        """The tokens the leader has in force (its first word after Hello); later reloads
        arrive through `on_credentials`. Raises EngineUnavailable if the leader is gone."""
        return await self._credentials

    def ready(self) -> None:
        """This frontend serves the inference port from now on."""
        self._send(p.Ready())

    def forward_load(self, load: EngineLoad) -> None:
        self._send(
            p.Load(
                load.data_parallel_rank,
                load.num_running_requests,
                load.num_waiting_requests,
                load.kv_cache_usage,
                load.unix_time_s,
            )
        )

    def close(self) -> None:
        self._writer.close()

    def _send(self, message: p.Message) -> None:
        if not self._writer.is_closing():
            self._writer.write(p.frame(message))

    async def _read(self) -> None:
        try:
            while (message := await p.read_message(self._reader)) is not None:
                if isinstance(message, p.Serving):
                    self.is_serving = message.is_serving
                    self.on_serving(message.is_serving)
                elif isinstance(message, p.Credentials):
                    if self._credentials.done():
                        self.on_credentials(message.tokens_text)
                    else:
                        self._credentials.set_result(message.tokens_text)
                elif isinstance(message, p.AbortRequests):
                    self.on_abort(message)
                else:
                    reply = self._replies.pop(message.seq, None)  # type: ignore[union-attr]  # every other message kind is a reply with a seq
                    if reply is not None and not reply.done():
                        reply.set_result(message)
        finally:
            self.lost.set()
            if not self._credentials.done():
                self._credentials.set_exception(EngineUnavailable(LEADER_GONE))
            for reply in self._replies.values():
                if not reply.done():
                    reply.set_exception(EngineUnavailable(LEADER_GONE))
            self._replies.clear()

    async def _ask(self, message: p.Admit | p.ListLoras) -> p.Message:
        if self.lost.is_set():
            raise EngineUnavailable(LEADER_GONE)
        reply = self._replies[message.seq] = asyncio.get_running_loop().create_future()
        self._send(message)
        answer = await reply
        if isinstance(answer, p.Refused):
            raise p.error_of(answer)
        return answer

    @contextlib.asynccontextmanager
    async def admission(self, request_id: str, num_bytes: int, lora_name: str) -> AsyncIterator[_Admission]:
        """Admitted by the leader (held there while paused) until the block ends; a caller
        that leaves while held leaves the leader's gate too."""
        seq = next(self._seqs)
        self._admitting.add(seq)
        try:
            answer = await self._ask(p.Admit(seq, request_id, num_bytes, lora_name))
            self._admitting.discard(seq)
            assert isinstance(answer, p.Admitted)
            admission = _Admission(self, seq, answer.aborted, answer.lora)
            yield admission
        finally:
            self._admitting.discard(seq)
            self._replies.pop(seq, None)
            self._send(p.Ended(seq))

    def abort_held(self) -> None:
        """Every request still waiting for admission ends unrun (shutdown)."""
        for seq in self._admitting:
            reply = self._replies.get(seq)
            if reply is not None and not reply.done():
                reply.set_result(p.Admitted(seq, aborted=True))

    def record(self, operation: str, detail: str, outcome: str) -> None:
        self._send(p.Record(operation, detail, outcome))

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self._send(p.Observed(method, code, seconds))

    async def loras(self) -> tuple[LoraAdapter, ...]:
        answer = await self._ask(p.ListLoras(next(self._seqs)))
        assert isinstance(answer, p.Loras)
        return answer.adapters


class _Admission:
    def __init__(self, link: LeaderLink, seq: int, aborted: bool, lora: LoraAdapter | None) -> None:
        self._link, self._seq = link, seq
        self.aborted, self.lora = aborted, lora

    def entered(self, internal_id: str) -> None:
        self._link._send(p.Entered(self._seq, internal_id))


class FollowerLifecycle:
    """What the servicers of a following frontend call instead of the lifecycle controller."""

    def __init__(self, engine: EngineAdapter, link: LeaderLink) -> None:
        self._engine = engine
        self._link = link
        link.on_abort = self._abort_from_leader
        self._aborting: set[asyncio.Task[None]] = set()

    def generate(self, params: GenerateParams) -> AsyncGenerator[GenerateChunk, None]:
        return self._generate(params)

    async def _generate(self, params: GenerateParams) -> AsyncGenerator[GenerateChunk, None]:
        if params.lora_name and not self._engine.lora_enabled:
            raise InvalidRequest("lora_name", "LoRA adapters are not enabled on this server (--enable-lora)")
        request = await self._engine.validate(params)
        async with self._link.admission(params.request_id, request.num_bytes, params.lora_name) as admission:
            if admission.aborted:
                for chunk in self._engine.aborted_before_start(request):
                    yield chunk
                return
            lora = admission.lora
            if lora is not None:
                request = replace(request, lora=lora)
            try:
                stream = await self._engine.submit(request)
            except BaseException:
                admission.entered("")
                raise
            admission.entered(stream.internal_id)
            async with contextlib.aclosing(stream.chunks()) as chunks:
                async for chunk in chunks:
                    yield chunk if lora is None else stamp_lora_version(chunk, lora)

    def _abort_from_leader(self, message: p.AbortRequests) -> None:
        task = asyncio.ensure_future(self._engine.abort(list(message.request_ids)))
        self._aborting.add(task)
        task.add_done_callback(self._aborting.discard)

    async def abort_everything(self) -> None:
        """Shutdown: every request of this frontend, held or in the engine, ends ABORTED now."""
        self._link.abort_held()
        await self._engine.abort_all()

    async def list_loras(self) -> tuple[LoraAdapter, ...]:
        return await self._link.loras()

    def record(self, operation: str, detail: str, outcome: str) -> None:
        """Audit a refused call in the leader's one audit log."""
        self._link.record(operation, detail, outcome)
