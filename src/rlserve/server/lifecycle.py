"""`rlserve.v1.Lifecycle`: the whole lifecycle state, its changes as a stream, the
compare-and-set version update, abandoning an update, the served weights' digests, the load,
and LoRA adapters pushed by the trainer."""

from __future__ import annotations

from typing import TypeAlias

import grpc

from rlserve.api.rlserve.v1 import lifecycle_pb2 as pb
from rlserve.api.rlserve.v1 import lifecycle_pb2_grpc
from rlserve.server import convert_lifecycle
from rlserve.server.errors import translate_errors
from rlserve.server.slot import EngineSlot

Ctx: TypeAlias = grpc.aio.ServicerContext


class LifecycleServicer(lifecycle_pb2_grpc.LifecycleServicer):
    def __init__(self, slot: EngineSlot, *, insecure_control: bool = False) -> None:
        self._slot = slot
        self._insecure_control = insecure_control

    @translate_errors
    async def GetState(self, request: pb.GetStateRequest, context: Ctx) -> pb.LifecycleState:
        state = convert_lifecycle.lifecycle_snapshot(await self._slot.lifecycle.snapshot())
        state.insecure_control = self._insecure_control
        return state

    @translate_errors
    async def WatchState(self, request: pb.WatchStateRequest, context: Ctx):
        async for state in self._slot.lifecycle.watch():
            yield convert_lifecycle.lifecycle_state(state)

    @translate_errors
    async def UpdateWeightVersion(self, request: pb.UpdateWeightVersionRequest, context: Ctx):
        previous = await self._slot.lifecycle.update_weight_version(
            request.weight_version, convert_lifecycle.expected_version(request)
        )
        return pb.UpdateWeightVersionResponse(previous_weight_version=previous)

    @translate_errors
    async def AbortWeightUpdate(self, request: pb.AbortWeightUpdateRequest, context: Ctx):
        await self._slot.lifecycle.weights.abort()
        return pb.AbortWeightUpdateResponse()

    @translate_errors
    async def PrepareWeightUpdate(self, request: pb.PrepareWeightUpdateRequest, context: Ctx):
        session = await self._slot.lifecycle.weights.prepare()
        return pb.PrepareWeightUpdateResponse(session=convert_lifecycle.update_session(session))

    @translate_errors
    async def StageWeightUpdate(self, request: pb.StageWeightUpdateRequest, context: Ctx):
        session = await self._slot.lifecycle.weights.start(staged=True)
        return pb.StageWeightUpdateResponse(session=convert_lifecycle.update_session(session))

    @translate_errors
    async def GetWeightChecksum(self, request: pb.GetWeightChecksumRequest, context: Ctx) -> pb.WeightChecksum:
        return convert_lifecycle.weight_checksum(await self._slot.lifecycle.weights.checksums())

    @translate_errors
    async def GetLoad(self, request: pb.GetLoadRequest, context: Ctx) -> pb.LoadReport:
        return convert_lifecycle.load_report(*self._slot.lifecycle.load())

    @translate_errors
    async def StartLoraUpdate(self, request: pb.StartLoraUpdateRequest, context: Ctx) -> pb.StartLoraUpdateResponse:
        await self._slot.lifecycle.loras.start_push(*convert_lifecycle.start_lora_update(request))
        return pb.StartLoraUpdateResponse()

    @translate_errors
    async def FinishLoraUpdate(self, request: pb.FinishLoraUpdateRequest, context: Ctx):
        adapter = await self._slot.lifecycle.loras.finish_push()
        return pb.FinishLoraUpdateResponse(adapter=convert_lifecycle.lora_adapter(adapter), version=adapter.version)
