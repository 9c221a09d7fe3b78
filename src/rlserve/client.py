"""Python clients for rlserve (and any server speaking vLLM's gRPC contract).

`Client` is blocking, `AsyncClient` is asyncio; both return the wire's own messages. Build
requests with `generate_request` or pass a ready `GenerateRequest`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlserve.api.vllm import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc

Prompt = str | Sequence[int] | inference_pb2.GenerateRequest


def generate_request(
    prompt: Prompt,
    *,
    max_new_tokens: int = 0,
    temperature: float | None = None,
    ignore_eos: bool = False,
    output_logprobs: bool = False,
    request_id: str = "",
    **fields: Any,
) -> inference_pb2.GenerateRequest:
    """A GenerateRequest for a text or token-id prompt; output token ids are always returned.
    `fields` are further GenerateRequest fields (e.g. sampling=RandomSampling(...))."""
    if isinstance(prompt, inference_pb2.GenerateRequest):
        return prompt
    req = inference_pb2.GenerateRequest(request_id=request_id, **fields)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    if temperature is not None:
        req.temperature = temperature
    req.stopping.max_new_tokens = max_new_tokens
    req.stopping.ignore_eos = ignore_eos
    req.response.output_token_ids = True
    req.response.output_logprobs = output_logprobs
    return req


class Client:
    """Blocking client: `with Client("127.0.0.1:50051") as c: print(c.generate("Hi").outputs.text)`."""

    def __init__(self, target: str, *, channel: grpc.Channel | None = None) -> None:
        self._channel = channel or grpc.insecure_channel(target)
        self.inference = inference_pb2_grpc.InferenceStub(self._channel)
        self.control = control_pb2_grpc.ControlStub(self._channel)

    @property
    def channel(self) -> grpc.Channel:
        return self._channel

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until the server reports SERVING (its engine has started), or raise
        grpc.RpcError with DEADLINE_EXCEEDED after `timeout_s`."""
        request = health_pb2.HealthCheckRequest(service="")
        watch = health_pb2_grpc.HealthStub(self._channel).Watch(request, timeout=timeout_s, wait_for_ready=True)
        for update in watch:
            if update.status == health_pb2.HealthCheckResponse.SERVING:
                watch.cancel()
                return

    def generate(self, prompt: Prompt, *, timeout_s: float | None = None, **kw: Any) -> inference_pb2.GenerateResponse:
        return self.inference.Generate(generate_request(prompt, **kw), timeout=timeout_s)

    def stream(
        self, prompt: Prompt, *, timeout_s: float | None = None, **kw: Any
    ) -> Iterator[inference_pb2.GenerateResponse]:
        return self.inference.GenerateStream(generate_request(prompt, **kw), timeout=timeout_s)

    def abort(self, *request_ids: str) -> None:
        self.control.Abort(control_pb2.AbortRequest(request_ids=request_ids))

    def server_info(self) -> control_pb2.ServerInfo:
        return self.control.GetServerInfo(control_pb2.GetServerInfoRequest())

    def model_info(self) -> control_pb2.ModelInfo:
        return self.control.GetModelInfo(control_pb2.GetModelInfoRequest())


class AsyncClient:
    """asyncio client: `async with AsyncClient(target) as c: r = await c.generate("Hi")`."""

    def __init__(self, target: str, *, channel: grpc.aio.Channel | None = None) -> None:
        self._channel = channel or grpc.aio.insecure_channel(target)
        self.inference = inference_pb2_grpc.InferenceStub(self._channel)
        self.control = control_pb2_grpc.ControlStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until the server reports SERVING (its engine has started), or grpc.RpcError with
        DEADLINE_EXCEEDED after `timeout_s`."""
        request = health_pb2.HealthCheckRequest(service="")
        watch = health_pb2_grpc.HealthStub(self._channel).Watch(request, timeout=timeout_s, wait_for_ready=True)
        async for update in watch:
            if update.status == health_pb2.HealthCheckResponse.SERVING:
                watch.cancel()
                return

    async def generate(
        self, prompt: Prompt, *, timeout_s: float | None = None, **kw: Any
    ) -> inference_pb2.GenerateResponse:
        return await self.inference.Generate(generate_request(prompt, **kw), timeout=timeout_s)

    async def stream(
        self, prompt: Prompt, *, timeout_s: float | None = None, **kw: Any
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        call = self.inference.GenerateStream(generate_request(prompt, **kw), timeout=timeout_s)
        async for response in call:
            yield response

    async def abort(self, *request_ids: str) -> None:
        await self.control.Abort(control_pb2.AbortRequest(request_ids=request_ids))

    async def server_info(self) -> control_pb2.ServerInfo:
        return await self.control.GetServerInfo(control_pb2.GetServerInfoRequest())

    async def model_info(self) -> control_pb2.ModelInfo:
        return await self.control.GetModelInfo(control_pb2.GetModelInfoRequest())
