"""The weight-transfer seam: the only code in the server process that knows backends.

Built once from the engine config. It parses a trainer's init_info and update_info into typed
objects exactly once, says what the backend can do, drives the workers and turns their typed
replies into domain errors. `GlooTransport` drives rlserve's own backend through the worker
extension: the rendezvous and the receiving run in worker threads and report over a Unix
socket, so vLLM's engine loop keeps stepping (and answering) meanwhile. `VllmTransport`
drives vLLM's in-place backends (nccl, ipc, ...) through vLLM's own calls, which block the
engine loop while they run. A new backend is one new class here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlserve.engine import vllm_compat
from rlserve.engine.liveness import EngineMonitor
from rlserve.engine.notices import NotificationHub, WorkerGone
from rlserve.errors import (
    CapabilityMissing,
    CommitFailed,
    EngineUnavailable,
    InvalidRequest,
    TransferTimeout,
    TransportNotReady,
)
from rlserve.types import ServedChecksums
from rlserve.wire.protocol import (
    BACKEND_NAME,
    CHECKSUM_ALGORITHM,
    SHM_BACKEND_NAME,
    ChunkInfo,
    ErrorCode,
    InitInfo,
    ProtocolError,
    Reply,
    combined_checksum,
)
from rlserve.wire.shm import ShmInit, open_segment, unlink_if_same
from rlserve.worker.extension import RlserveWorkerExtension as Ext

# Room for the worker's own deadline to fire first and report what went wrong.
DEADLINE_MARGIN_S = 5.0
# Each digest call runs between engine steps for at most this long.
DIGEST_SLICE_S = 0.05


@dataclass(frozen=True)
class TransportInit:
    timeout_s: float
    detail: str  # for the audit log: where the trainer is, never a secret
    payload: Mapping[str, Any]
    # The host the workers will connect to, if they connect anywhere.
    trainer_host: str | None = None


@dataclass(frozen=True)
class Chunk:
    num_tensors: int
    num_bytes: int
    payload: Any
    # A chunk of patches applies to this served weight version only.
    base_weight_version: str | None = None


class WeightTransport(ABC):
    backend: str
    # All or nothing: received weights are staged and touch the model only at finish.
    stages_updates: bool

    @abstractmethod
    def parse_init(self, raw: Any, max_timeout_s: float) -> TransportInit:
        """Raises InvalidRequest naming init_info_json."""

    @abstractmethod
    def parse_chunk(self, raw: Any) -> Chunk:
        """Raises InvalidRequest naming update_info_json."""

    @abstractmethod
    async def init(self, init: TransportInit) -> None:
        """Rendezvous with the trainer. Cancelling the call ends it. Raises TransferTimeout,
        InvalidRequest."""

    @abstractmethod
    async def start(self, is_draft: bool, timeout_s: float) -> None: ...

    @abstractmethod
    async def update(self, chunk: Chunk, timeout_s: float) -> int:
        """Receive one chunk; returns the bytes the update holds beside the served weights
        now (the largest worker's; 0 in place). Raises InvalidRequest, TransferTimeout (the
        transport is then out of step with the trainer and needs a new init)."""

    async def prepare(self, timeout_s: float) -> int:
        """Everything the commit could fail at, done beside the served weights; returns what
        `update` does. Raises CommitFailed (nothing went live). A backend that writes into
        the live weights has nothing left to prepare."""
        return 0

    @abstractmethod
    async def finish(self, timeout_s: float) -> None:
        """Commit. Raises CommitFailed."""

    @abstractmethod
    async def abort(self, timeout_s: float) -> None: ...

    @abstractmethod
    async def checksums(self) -> list[ServedChecksums]:
        """One per worker."""

    async def start_lora(self, timeout_s: float) -> None:
        """Open a session whose chunks make a LoRA adapter. Raises CapabilityMissing."""
        raise CapabilityMissing(f"the {self.backend} backend cannot push LoRA adapters; use LoadLora from disk")

    async def write_lora(self, directory: str, adapter_config: Mapping[str, Any], timeout_s: float) -> str:
        """End a LoRA session: the adapter as a PEFT directory vLLM loads from (its path)."""
        raise CapabilityMissing(f"the {self.backend} backend cannot push LoRA adapters")

    async def close(self) -> None:
        pass


def make_transport(
    llm: Any, backend: str, monitor: EngineMonitor, num_workers: int, *, in_place: bool = False
) -> WeightTransport | None:
    """`in_place`: rlserve's backends install each layer as it arrives (vLLM's always do)."""
    if not backend:
        return None
    if backend == BACKEND_NAME:
        return GlooTransport(llm, monitor, num_workers, in_place=in_place)
    if backend == SHM_BACKEND_NAME:
        return ShmTransport(llm, monitor, num_workers, in_place=in_place)
    return VllmTransport(llm, monitor, num_workers, backend)


class _Workers:
    """collective_rpc on every worker of every data-parallel engine, with typed replies."""

    def __init__(self, llm: Any, monitor: EngineMonitor, num_workers: int) -> None:
        self._llm, self._monitor, self.num_workers = llm, monitor, num_workers

    async def call(self, method: Callable[..., Any], *args: Any, field: str = "") -> list[Reply]:
        per_engine = await self._monitor.guard(vllm_compat.collective_rpc_everywhere(self._llm, method.__name__, args))
        replies = [Reply.from_dict(r) for workers in per_engine for r in workers]
        for reply in replies:
            raise_for(reply, field)
        return replies


def _shadow_bytes(replies: list[Reply]) -> int:
    return max((int(r.data.get("shadow_bytes", 0)) for r in replies), default=0)


def raise_for(reply: Reply, field: str) -> None:
    if reply.ok:
        return
    message = reply.message
    if reply.code in (ErrorCode.INVALID_INFO, ErrorCode.CHECKSUM_MISMATCH):
        raise InvalidRequest(field, message)
    if reply.code is ErrorCode.TIMEOUT:
        raise TransferTimeout(message)
    if reply.code is ErrorCode.WRONG_STATE:
        raise TransportNotReady(message)
    if reply.code is ErrorCode.COMMIT_FAILED:
        raise CommitFailed(message)
    if reply.code is ErrorCode.UNSUPPORTED:
        raise CapabilityMissing(message)
    raise RuntimeError(f"a worker failed: {message}")


def _parse_init_info(parse: Callable[[Mapping[str, Any], float], Any], raw: Any, max_timeout_s: float) -> Any:
    """An rlserve backend's typed init_info; INVALID_ARGUMENT naming init_info_json."""
    if not isinstance(raw, Mapping):
        raise InvalidRequest("init_info_json", "must be a JSON object")
    try:
        return parse(raw, max_timeout_s)
    except ProtocolError as e:
        raise InvalidRequest("init_info_json", str(e)) from e


class GlooTransport(WeightTransport):
    backend = BACKEND_NAME

    def __init__(self, llm: Any, monitor: EngineMonitor, num_workers: int, *, in_place: bool = False) -> None:
        self.stages_updates = not in_place
        self._workers = _Workers(llm, monitor, num_workers)
        self._monitor = monitor
        self._hub = NotificationHub()

    def parse_init(self, raw: Any, max_timeout_s: float) -> TransportInit:
        info = _parse_init_info(InitInfo.parse, raw, max_timeout_s)
        if info.rank_offset + self._workers.num_workers > info.world_size:
            raise InvalidRequest(
                "init_info_json",
                f"world_size {info.world_size} has no rank for every one of this server's "
                f"{self._workers.num_workers} workers from rank_offset {info.rank_offset}",
            )
        detail = f"trainer={info.master_address[:64]}:{info.master_port} world_size={info.world_size}"
        return TransportInit(info.timeout_s, detail, info.to_json(), info.master_address)

    def parse_chunk(self, raw: Any) -> Chunk:
        if isinstance(raw, list):
            # vLLM's list form, one entry per worker: every worker receives the same broadcast.
            if len(raw) != self._workers.num_workers or any(entry != raw[0] for entry in raw):
                raise InvalidRequest(
                    "update_info_json",
                    f"the list form needs one entry per worker ({self._workers.num_workers}), all equal: "
                    "rlserve_gloo sends every worker the same chunk",
                )
            raw = raw[0]
        try:
            chunk = ChunkInfo.parse(raw)
        except ProtocolError as e:
            raise InvalidRequest("update_info_json", str(e)) from e
        return Chunk(len(chunk.tensors), chunk.num_bytes, chunk.to_json(), chunk.base_weight_version)

    async def init(self, init: TransportInit) -> None:
        op = uuid.uuid4().hex
        try:
            await self._in_workers(
                op, init.timeout_s, "init_info_json", Ext.rlserve_begin_init, dict(init.payload), init.timeout_s
            )
        except BaseException:
            # Also when the caller went away: the rendezvous it asked for is no longer wanted.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._workers.call(Ext.rlserve_cancel_init, op))
            raise

    async def start(self, is_draft: bool, timeout_s: float) -> None:
        if is_draft:
            raise CapabilityMissing(f"{self.backend} cannot update a draft model")
        await self._workers.call(Ext.rlserve_begin_session, not self.stages_updates)

    async def update(self, chunk: Chunk, timeout_s: float) -> int:
        replies = await self._in_workers(
            uuid.uuid4().hex, timeout_s, "update_info_json", Ext.rlserve_begin_chunk, chunk.payload, timeout_s
        )
        return _shadow_bytes(replies)

    async def start_lora(self, timeout_s: float) -> None:
        await self._workers.call(Ext.rlserve_begin_lora_session)

    async def write_lora(self, directory: str, adapter_config: Mapping[str, Any], timeout_s: float) -> str:
        # Every worker received the same adapter; each writes its copy, vLLM loads the first.
        await self._workers.call(Ext.rlserve_write_lora, directory, dict(adapter_config), field="update_info_json")
        return f"{directory}/0"

    async def prepare(self, timeout_s: float) -> int:
        with self._monitor.busy(timeout_s):
            return _shadow_bytes(await self._workers.call(Ext.rlserve_prepare))

    async def finish(self, timeout_s: float) -> None:
        with self._monitor.busy(timeout_s):
            await self._workers.call(Ext.rlserve_commit)

    async def abort(self, timeout_s: float) -> None:
        await self._workers.call(Ext.rlserve_abort_session)

    async def checksums(self) -> list[ServedChecksums]:
        return await _digest(self._workers)

    async def close(self) -> None:
        await self._hub.close()

    async def _in_workers(
        self, op: str, timeout_s: float, field: str, begin: Callable[..., Any], *args: Any
    ) -> list[Reply]:
        """Start `begin` in every worker's transfer thread and wait for every notice."""
        await self._hub.start()
        workers = range(self._workers.num_workers)
        notices = self._hub.expect(op, workers)
        try:
            await self._workers.call(begin, op, self._hub.address, *args, field=field)
            done, pending = await asyncio.wait(notices, timeout=timeout_s + DEADLINE_MARGIN_S)
            if pending:
                raise TransferTimeout(f"the trainer did not complete the transfer within {timeout_s:.0f} s")
            for notice in done:
                try:
                    reply = notice.result()
                except WorkerGone as e:
                    raise EngineUnavailable(str(e)) from e
                raise_for(reply, field)
            return [notice.result() for notice in done]
        finally:
            self._hub.forget(op, workers)


class ShmTransport(GlooTransport):
    """rlserve_shm: the trainer's segment instead of a gloo group; chunks, staging, commit
    and digests as rlserve_gloo. The segment is opened here first (what is no segment of this
    user is refused before a worker is asked, and left alone); once every worker has opened
    it its name is removed, if it still names that file, so no crash can leave it behind in
    /dev/shm."""

    backend = SHM_BACKEND_NAME

    def parse_init(self, raw: Any, max_timeout_s: float) -> TransportInit:
        info = _parse_init_info(ShmInit.parse, raw, max_timeout_s)
        return TransportInit(info.timeout_s, f"segment={info.segment} size={info.size}", info.to_json())

    async def init(self, init: TransportInit) -> None:
        name = init.payload["segment"]
        try:
            fd, opened = open_segment(name, init.payload["size"])
        except ProtocolError as e:
            raise InvalidRequest("init_info_json", str(e)) from e
        try:
            await super().init(init)
            unlink_if_same(name, opened)
        finally:
            os.close(fd)


class VllmTransport(WeightTransport):
    """vLLM's own backends write into the live weights; their calls block the engine loop."""

    stages_updates = False

    def __init__(self, llm: Any, monitor: EngineMonitor, num_workers: int, backend: str) -> None:
        self._llm, self._monitor, self.backend = llm, monitor, backend
        self._workers = _Workers(llm, monitor, num_workers)

    def parse_init(self, raw: Any, max_timeout_s: float) -> TransportInit:
        if not isinstance(raw, Mapping):
            raise InvalidRequest("init_info_json", "must be a JSON object")
        keys = ("master_address", "master_port", "rank_offset", "world_size")
        detail = " ".join(f"{k}={str(raw[k])[:64]}" for k in keys if k in raw and isinstance(raw[k], (str, int)))
        host = raw.get("master_address")
        return TransportInit(max_timeout_s, detail, dict(raw), host if isinstance(host, str) else None)

    def parse_chunk(self, raw: Any) -> Chunk:
        # vLLM >= 0.29 also takes a list with one object per worker (dp index x world size + rank).
        entries: Sequence[Any] = raw if isinstance(raw, list) else [raw]
        if not entries or not all(isinstance(e, Mapping) for e in entries):
            raise InvalidRequest("update_info_json", "must be a JSON object, or a list of one object per worker")
        names = entries[0].get("names")
        return Chunk(len(names) if isinstance(names, list) else 0, 0, raw)

    async def init(self, init: TransportInit) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._blocking(
            init.timeout_s, self._llm.init_weight_transfer_engine(WeightTransferInitRequest(dict(init.payload)))
        )

    async def start(self, is_draft: bool, timeout_s: float) -> None:
        call = self._llm.start_draft_weight_update() if is_draft else self._llm.start_weight_update()
        await self._blocking(timeout_s, call)

    async def update(self, chunk: Chunk, timeout_s: float) -> int:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._blocking(timeout_s, self._llm.update_weights(WeightTransferUpdateRequest(chunk.payload)))
        return 0  # written into the live weights

    async def finish(self, timeout_s: float) -> None:
        try:
            await self._blocking(timeout_s, self._llm.finish_weight_update())
        except RuntimeError as e:
            raise CommitFailed(str(e)) from e
        finally:
            await self._workers.call(Ext.rlserve_forget_digests)

    async def abort(self, timeout_s: float) -> None:
        # vLLM cannot abandon an update; finishing closes its session bookkeeping so the next
        # start works. The controller marks the half-written weights inconsistent.
        with contextlib.suppress(RuntimeError):
            await self._blocking(timeout_s, self._llm.finish_weight_update())
        await self._workers.call(Ext.rlserve_forget_digests)

    async def checksums(self) -> list[ServedChecksums]:
        return await _digest(self._workers)

    async def _blocking(self, timeout_s: float, call: Any) -> None:
        with self._monitor.busy(timeout_s):
            try:
                await self._monitor.guard(asyncio.wait_for(call, timeout_s + DEADLINE_MARGIN_S))
            except TimeoutError as e:
                raise TransferTimeout(f"the {self.backend} backend did not finish within {timeout_s:.0f} s") from e
            except ValueError as e:  # vLLM's parse of a backend's init/update info
                raise InvalidRequest("", str(e)) from e


async def _digest(workers: _Workers) -> list[ServedChecksums]:
    """Digest the served weights in slices between engine steps, until every worker is done."""
    while True:
        replies = await workers.call(Ext.rlserve_digest, DIGEST_SLICE_S)
        if all(r.data.get("done") for r in replies):
            out = []
            for r in replies:
                per_tensor = dict(r.data["per_tensor"])
                overall = combined_checksum(per_tensor)
                out.append(ServedChecksums(CHECKSUM_ALGORITHM, overall, per_tensor, tuple(r.data["inconsistent"])))
            return out
