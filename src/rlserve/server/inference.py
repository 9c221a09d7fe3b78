"""`vllm.Inference`: proto in, engine generation, proto out. No logic beyond translation."""

from __future__ import annotations

import contextlib

import grpc

from rlserve.api.vllm import inference_pb2, inference_pb2_grpc
from rlserve.config import RequestLimits
from rlserve.server import convert
from rlserve.server.errors import translate_errors
from rlserve.server.slot import EngineSlot


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, slot: EngineSlot, limits: RequestLimits) -> None:
        self._slot = slot
        self._limits = limits

    @translate_errors
    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GenerateResponse:
        params = convert.generate_params(request, is_stream=False, limits=self._limits)
        chunks = [c async for c in self._slot.serving.generate(params)]
        # FINAL_ONLY output: one chunk for the one sequence (n > 1 is refused for unary).
        return convert.generate_response(chunks[-1], params)

    @translate_errors
    async def GenerateStream(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # Written with context.write, not yielded: a coroutine handler passes the access check
        # and the error translation once per call, where a generator would pass each message
        # through both.
        params = convert.generate_params(request, is_stream=True, limits=self._limits)
        async with contextlib.aclosing(self._slot.serving.generate(params)) as chunks:
            async for chunk in chunks:
                await context.write(convert.generate_response(chunk, params))
