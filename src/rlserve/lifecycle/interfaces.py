"""The two written interfaces of the server's process:

- `Serving`: what every frontend process's servicers and server call for generation, LoRA
  listing and audit: the leader's `LifecycleController`, or a follower's `FollowerLifecycle`
  (which asks the leader). The control RPCs need the controller itself (`EngineSlot.controller`).
- `ControlledEngine`: what the lifecycle controller and its weight updates need of an engine:
  `EngineAdapter`, or a test's fake engine for the edges a real CPU engine cannot reach.

mypy checks both sides (`make test`). No grpc here."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable
from typing import TYPE_CHECKING, Protocol

from rlserve.types import EngineStatus, GenerateChunk, GenerateParams, LoraAdapter, PauseMode, RlCapabilities

if TYPE_CHECKING:
    from rlserve.engine.adapter import PreparedRequest
    from rlserve.engine.liveness import EngineMonitor
    from rlserve.engine.load import LoadBoard
    from rlserve.engine.stream import RequestStream
    from rlserve.engine.transport import WeightTransport


class Serving(Protocol):
    def generate(self, params: GenerateParams) -> AsyncGenerator[GenerateChunk, None]: ...

    async def abort_everything(self) -> None: ...

    async def list_loras(self) -> tuple[LoraAdapter, ...]: ...

    def record(self, operation: str, detail: str, outcome: str) -> None: ...


class ControlledEngine(Protocol):
    monitor: EngineMonitor
    load: LoadBoard | None
    transport: WeightTransport | None

    # Generation
    async def validate(self, params: GenerateParams, lora: LoraAdapter | None = None) -> PreparedRequest: ...

    async def submit(self, request: PreparedRequest) -> RequestStream: ...

    def aborted_before_start(self, request: PreparedRequest) -> list[GenerateChunk]: ...

    async def abort(self, request_ids: Iterable[str]) -> None: ...

    async def abort_all(self) -> None: ...

    # Lifecycle operations, under the controller's lock
    async def pause(self, mode: PauseMode, clear_cache: bool) -> None: ...

    async def resume(self) -> None: ...

    async def requests_done(self) -> None: ...

    async def sleep(self, level: int, mode: PauseMode) -> None: ...

    async def wake_up(self, tags: list[str] | None) -> bool: ...

    async def reset_prefix_cache(self) -> bool: ...

    async def set_weight_version(self, version: str) -> None: ...

    async def weight_version(self) -> str: ...

    # Description
    async def engine_statuses(self) -> list[EngineStatus]: ...

    def capabilities(self) -> RlCapabilities: ...

    @property
    def weight_dtype(self) -> str: ...

    @property
    def weight_bytes(self) -> int: ...

    @property
    def logprobs_mode(self) -> str: ...

    # LoRA adapters
    @property
    def lora_enabled(self) -> bool: ...

    @property
    def max_loaded_loras(self) -> int: ...

    def require_lora(self) -> None: ...

    def check_lora(self, path: str) -> None: ...

    async def add_lora(self, adapter: LoraAdapter) -> None: ...

    async def remove_lora(self, adapter: LoraAdapter) -> None: ...
