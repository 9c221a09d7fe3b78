"""`vllm.Control`: server/model info, abort and KV event sources.

The RL lifecycle RPCs (pause, sleep, weight transfer, version) are not overridden yet, so the
generated base class answers them UNIMPLEMENTED.
"""

from __future__ import annotations

import grpc

from rlserve.api.vllm import control_pb2, control_pb2_grpc
from rlserve.server import convert
from rlserve.server.backend import EngineSlot
from rlserve.server.errors import translate_errors


class ControlServicer(control_pb2_grpc.ControlServicer):
    def __init__(self, slot: EngineSlot) -> None:
        self._slot = slot

    @translate_errors
    async def GetServerInfo(self, request: control_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext):
        return convert.server_info(self._slot.engine.server_info())

    @translate_errors
    async def GetModelInfo(self, request: control_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext):
        return convert.model_info(self._slot.engine.model_info())

    @translate_errors
    async def Abort(self, request: control_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        await self._slot.engine.abort(request.request_ids)
        return control_pb2.AbortResponse()

    @translate_errors
    async def GetKvEventSources(
        self, request: control_pb2.GetKvEventSourcesRequest, context: grpc.aio.ServicerContext
    ):
        return convert.kv_event_sources(self._slot.engine.kv_event_sources())
