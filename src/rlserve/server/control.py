"""`vllm.Control`: server/model info, abort, KV event sources, and the RL lifecycle RPCs
(pause, sleep, weight transfer, weight version) translated onto the lifecycle controller."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import grpc

from rlserve.api.vllm import control_pb2 as pb
from rlserve.api.vllm import control_pb2_grpc
from rlserve.config import RequestLimits
from rlserve.server import convert, convert_lifecycle
from rlserve.server.errors import translate_errors
from rlserve.server.slot import EngineSlot

Ctx: TypeAlias = grpc.aio.ServicerContext


class ControlServicer(control_pb2_grpc.ControlServicer):
    def __init__(self, slot: EngineSlot, limits: RequestLimits, on_shutdown: Callable[[], None] = lambda: None) -> None:
        """`on_shutdown()` starts a graceful shutdown (after this RPC has answered)."""
        self._slot = slot
        self._limits = limits
        self._on_shutdown = on_shutdown

    @translate_errors
    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: Ctx) -> pb.ServerInfo:
        return convert.server_info(self._slot.engine.server_info())

    @translate_errors
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Ctx) -> pb.ModelInfo:
        return convert.model_info(self._slot.engine.model_info())

    @translate_errors
    async def Abort(self, request: pb.AbortRequest, context: Ctx) -> pb.AbortResponse:
        await self._slot.lifecycle.abort(convert_lifecycle.abort_ids(request, self._limits))
        return pb.AbortResponse()

    @translate_errors
    async def LoadLora(self, request: pb.LoadLoraRequest, context: Ctx) -> pb.LoadLoraResponse:
        adapter = await self._slot.lifecycle.loras.load(request.lora_name, request.source_path)
        return pb.LoadLoraResponse(adapter=convert_lifecycle.lora_adapter(adapter))

    @translate_errors
    async def UnloadLora(self, request: pb.UnloadLoraRequest, context: Ctx) -> pb.UnloadLoraResponse:
        adapter = await self._slot.lifecycle.loras.unload(request.lora_name)
        return pb.UnloadLoraResponse(adapter=convert_lifecycle.lora_adapter(adapter))

    @translate_errors
    async def ListLoras(self, request: pb.ListLorasRequest, context: Ctx) -> pb.ListLorasResponse:
        return pb.ListLorasResponse(
            adapters=[convert_lifecycle.lora_adapter(a) for a in await self._slot.serving.list_loras()]
        )

    @translate_errors
    async def GetKvEventSources(self, request: pb.GetKvEventSourcesRequest, context: Ctx):
        return convert.kv_event_sources(self._slot.engine.kv_event_sources())

    @translate_errors
    async def PauseGeneration(self, request: pb.PauseGenerationRequest, context: Ctx):
        await self._slot.lifecycle.pause(*convert_lifecycle.pause_request(request))
        return pb.PauseGenerationResponse()

    @translate_errors
    async def ResumeGeneration(self, request: pb.ResumeGenerationRequest, context: Ctx):
        await self._slot.lifecycle.resume()
        return pb.ResumeGenerationResponse()

    @translate_errors
    async def IsPaused(self, request: pb.IsPausedRequest, context: Ctx) -> pb.IsPausedResponse:
        return pb.IsPausedResponse(paused=self._slot.lifecycle.state.is_paused)

    @translate_errors
    async def Sleep(self, request: pb.SleepRequest, context: Ctx) -> pb.SleepResponse:
        await self._slot.lifecycle.sleep(*convert_lifecycle.sleep_request(request))
        return pb.SleepResponse()

    @translate_errors
    async def WakeUp(self, request: pb.WakeUpRequest, context: Ctx) -> pb.WakeUpResponse:
        await self._slot.lifecycle.wake_up(convert_lifecycle.wake_tags(request))
        return pb.WakeUpResponse()

    @translate_errors
    async def IsSleeping(self, request: pb.IsSleepingRequest, context: Ctx) -> pb.IsSleepingResponse:
        return pb.IsSleepingResponse(sleeping=self._slot.lifecycle.state.is_sleeping)

    @translate_errors
    async def UpdateWeightVersion(self, request: pb.UpdateWeightVersionRequest, context: Ctx):
        await self._slot.lifecycle.update_weight_version(request.weight_version)
        return pb.UpdateWeightVersionResponse()

    @translate_errors
    async def GetWeightVersion(self, request: pb.GetWeightVersionRequest, context: Ctx):
        return pb.GetWeightVersionResponse(weight_version=self._slot.lifecycle.state.weight_version)

    @translate_errors
    async def InitWeightTransferEngine(self, request: pb.InitWeightTransferEngineRequest, context: Ctx):
        await self._slot.lifecycle.weights.init(request.init_info_json)
        return pb.InitWeightTransferEngineResponse()

    @translate_errors
    async def StartWeightUpdate(self, request: pb.StartWeightUpdateRequest, context: Ctx):
        await self._slot.lifecycle.weights.start(is_draft=False)
        return pb.StartWeightUpdateResponse()

    @translate_errors
    async def StartDraftWeightUpdate(self, request: pb.StartDraftWeightUpdateRequest, context: Ctx):
        await self._slot.lifecycle.weights.start(is_draft=True)
        return pb.StartDraftWeightUpdateResponse()

    @translate_errors
    async def UpdateWeights(self, request: pb.UpdateWeightsRequest, context: Ctx) -> pb.UpdateWeightsResponse:
        await self._slot.lifecycle.weights.update(request.update_info_json)
        return pb.UpdateWeightsResponse()

    @translate_errors
    async def FinishWeightUpdate(self, request: pb.FinishWeightUpdateRequest, context: Ctx):
        await self._slot.lifecycle.weights.finish(convert_lifecycle.finish_version(request))
        return pb.FinishWeightUpdateResponse()

    @translate_errors
    async def Shutdown(self, request: pb.ShutdownRequest, context: Ctx) -> pb.ShutdownResponse:
        lifecycle = self._slot.serving_or_none
        if lifecycle is not None:
            lifecycle.record("shutdown", "requested over Control/Shutdown", "ok")
        self._on_shutdown()
        return pb.ShutdownResponse()
