"""The LoRA room: loading adapters from disk, unloading them, retiring replaced versions once
their last request ends, and adapters a trainer pushes over the weight transport. What a name
means is `LoraRegistry`'s; every change here takes the state owner's lock and is audited, like
the rest of the lifecycle. The push's chunks are `WeightUpdates.update`'s (one session kind
among others). No grpc."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlserve.lifecycle.lease import SessionLease
from rlserve.lifecycle.loras import LoraRegistry, adapter_digest, check_source
from rlserve.lifecycle.mutation import survives_caller_cancellation
from rlserve.lifecycle.owner import StateOwner
from rlserve.lifecycle.state import UpdateSession, check_can_open_session, require_session
from rlserve.types import GenerateChunk, LoraAdapter

if TYPE_CHECKING:
    from rlserve.engine.transport import WeightTransport
    from rlserve.lifecycle.interfaces import ControlledEngine

# A LoRA adapter's name, like a request id (the wire checks it too).
MAX_LORA_NAME_BYTES = 256


def stamp_lora_version(chunk: GenerateChunk, lora: LoraAdapter) -> GenerateChunk:
    """A sequence's last chunk says which version of its adapter sampled it."""
    if chunk.sequence.finish is None:
        return chunk
    return replace(chunk, sequence=replace(chunk.sequence, lora_version=lora.version))


class LoraAdapters:
    def __init__(
        self,
        owner: StateOwner,
        engine: ControlledEngine,
        transport: Callable[[], WeightTransport],
        lease: SessionLease,
        timeout_s: float,
    ) -> None:
        """`transport()` is the engine's weight transport, or raises CapabilityMissing."""
        self._owner = owner
        self._engine = engine
        self._transport = transport
        self._lease = lease
        self._timeout_s = timeout_s
        self.registry = LoraRegistry(engine.max_loaded_loras)
        self.registry.on_retired = self._retire_later
        self._retiring: set[asyncio.Task[None]] = set()
        # The open push's version label, adapter config and whether it is a new version.
        self._push: tuple[str, dict[str, Any], bool] = ("", {}, False)

    def adapters(self) -> tuple[LoraAdapter, ...]:
        return self.registry.adapters()

    # From disk -----------------------------------------------------------------------------

    async def load(self, name: str, source_path: str) -> LoraAdapter:
        """Load an adapter from disk under `name` (see LoraRegistry for what a name means).
        Raises CapabilityMissing, InvalidRequest, NameTaken, Overloaded."""
        self._engine.require_lora()
        path = check_source(name, source_path, MAX_LORA_NAME_BYTES)
        await asyncio.to_thread(self._engine.check_lora, str(path))
        digest = await asyncio.to_thread(adapter_digest, path)
        async with self._owner.lock:
            with self._owner.audited("load_lora", f"{name[:64]!r} from {source_path[:128]!r}") as outcome:
                existing = self.registry.existing(name, source_path, digest)
                if existing is not None:
                    outcome.append("noop")
                    return existing
                adapter = self.registry.new(name, source_path, digest)
                await self._engine.add_lora(adapter)
                self.registry.add(adapter)
                return adapter

    async def unload(self, name: str) -> LoraAdapter:
        """Raises CapabilityMissing, NotFound, WrongState (in use by running requests)."""
        self._engine.require_lora()
        async with self._owner.lock:
            with self._owner.audited("unload_lora", f"{name[:64]!r}"):
                adapter = self.registry.removable(name)
                await self._unload(adapter)
                self.registry.remove(name)
                return adapter

    def _retire_later(self, adapter: LoraAdapter) -> None:
        """An old version whose last request just ended: unload it (it was replaced)."""

        async def retire() -> None:
            async with self._owner.lock:
                with self._owner.audited("retire_lora", f"{adapter.lora_name[:64]!r} id={adapter.lora_id}"):
                    await self._unload(adapter)

        self._retiring.add(task := asyncio.ensure_future(retire()))
        task.add_done_callback(self._retiring.discard)

    async def _unload(self, adapter: LoraAdapter) -> None:
        """Under the lock: out of the engine, and its directory if rlserve wrote it."""
        await self._engine.remove_lora(adapter)
        if adapter.owned_dir:
            shutil.rmtree(adapter.owned_dir, ignore_errors=True)

    # Pushed by a trainer -------------------------------------------------------------------

    @survives_caller_cancellation
    async def start_push(self, name: str, version: str, adapter_config: Mapping[str, Any], new_version: bool) -> None:
        """Open a session whose chunks make adapter `name` (generation goes on meanwhile: the
        adapter is swapped in at finish). A loaded name needs `new_version`. Raises
        CapabilityMissing, NameTaken (ABORTED), UpdateInProgress, TransportNotReady."""
        async with self._owner.lock:
            with self._owner.audited("start_lora_update", f"{name[:64]!r} version={version[:64]!r}"):
                self._engine.require_lora()
                transport = self._transport()
                check_can_open_session(self._owner.state)
                self.registry.check_new_version(name, new_version)
                await transport.start_lora(self._timeout_s)
                session = UpdateSession(uuid.uuid4().hex, False, time.time(), lora_name=name)
                self._push = (version, dict(adapter_config), new_version)
                self._owner.publish(lambda s: s.in_session(session))
                self._lease.arm(session.session_id)

    @survives_caller_cancellation
    async def finish_push(self) -> LoraAdapter:
        """The pushed adapter, checked whole and written out by the workers, is loaded and
        serves every request admitted from now on; requests already running keep the
        version they started with, and the old version is unloaded after the last of them.
        A failure leaves the old version serving. Raises NoUpdateSession, InvalidRequest."""
        async with self._owner.lock:
            with self._owner.audited("finish_lora_update", ""):
                session = require_session(self._owner.state, "FinishLoraUpdate", lora=True)
                version, adapter_config, new_version = self._push
                transport = self._transport()
                self._lease.disarm()
                directory = tempfile.mkdtemp(prefix=f"rlserve-lora-{session.session_id[:8]}-")
                try:
                    self.registry.check_new_version(session.lora_name, new_version)
                    path = await transport.write_lora(directory, adapter_config, self._timeout_s)
                    digest = await asyncio.to_thread(adapter_digest, Path(path))
                    adapter = self.registry.new(session.lora_name, path, digest, version, directory)
                    await self._engine.add_lora(adapter)
                except BaseException:
                    shutil.rmtree(directory, ignore_errors=True)
                    self._owner.publish(lambda s: s.in_session(None))
                    raise
                old = self.registry.add(adapter)
                self._owner.publish(lambda s: s.in_session(None))
                if old is not None:
                    await self._unload(old)
                return adapter
