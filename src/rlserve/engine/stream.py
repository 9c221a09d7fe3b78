"""One submitted request's outputs, from vLLM's output collector to rlserve's chunks: ended by
the engine, by its reader leaving (which aborts it in the engine), or by a dead engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from vllm.outputs import RequestOutput
from vllm.v1.engine.exceptions import EngineDeadError

from rlserve.engine.outputs import OutputTranslator
from rlserve.errors import EngineUnavailable
from rlserve.types import GenerateChunk


class RequestStream:
    """The outputs of one submitted request. Closing it before its end aborts the request.
    It is in `open_streams` until it ends, so a dead engine can fail it."""

    def __init__(
        self,
        collector: Any,
        translator: OutputTranslator,
        open_streams: set[RequestStream],
        abort: Callable[[str], Awaitable[None]],
    ) -> None:
        self._collector = collector
        self._translator = translator
        self._open_streams = open_streams
        self._abort = abort
        open_streams.add(self)

    @property
    def internal_id(self) -> str:
        return self._collector.request_id

    def fail(self, error: Exception) -> None:
        self._collector.put(error)

    async def chunks(self) -> AsyncGenerator[GenerateChunk, None]:
        finished = False
        try:
            while not finished:
                # Drain without awaiting when an output is ready (fewer task switches).
                out: RequestOutput = self._collector.get_nowait() or await self._collector.get()
                finished = out.finished
                for chunk in self._translator.translate(out):
                    yield chunk
        except EngineDeadError as e:
            raise EngineUnavailable("the engine died; restart the server") from e
        finally:
            self._collector.close()
            self._open_streams.discard(self)
            if not finished:
                # The client went away, or translating failed: the engine must not run on.
                await asyncio.shield(self._abort(self.internal_id))
