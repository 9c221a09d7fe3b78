"""Python clients for rlserve (and any server speaking vLLM's gRPC contract).

`Client` is blocking, `AsyncClient` is asyncio; both return the wire's own messages. Build
requests with `generate_request` or pass a ready `GenerateRequest`. Both take a bearer token
and TLS roots (and a client certificate for mutual TLS) through `ChannelCredentials`.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlserve.api.vllm import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc

Prompt = str | Sequence[int] | inference_pb2.GenerateRequest


class ResponseStream(Iterator[inference_pb2.GenerateResponse], Protocol):
    """GenerateStream's responses as gRPC's call object yields them; `cancel()` ends the
    call (and so the request) when the reader leaves early, a no-op once it has ended."""

    def cancel(self) -> bool: ...


@dataclass(frozen=True)
class ChannelCredentials:
    """How to reach a server that authenticates: a bearer token (sent as call metadata
    `authorization: Bearer ...`), and for TLS the CA that signed the server's certificate,
    plus a client certificate and key for mutual TLS. PEM bytes; nothing secret is shown."""

    token: str | None = field(default=None, repr=False)
    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = field(default=None, repr=False)
    # The name the server's certificate is checked against, when it differs from the target.
    server_name: str | None = None

    @classmethod
    def from_files(
        cls,
        *,
        token: str | None = None,
        root_certificates: str | Path | None = None,
        certificate_chain: str | Path | None = None,
        private_key: str | Path | None = None,
        server_name: str | None = None,
    ) -> ChannelCredentials:
        def read(path: str | Path | None) -> bytes | None:
            return Path(path).read_bytes() if path is not None else None

        return cls(token, read(root_certificates), read(certificate_chain), read(private_key), server_name)

    @property
    def uses_tls(self) -> bool:
        return self.root_certificates is not None or self.certificate_chain is not None

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def ssl(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


def open_channel(target: str, credentials: ChannelCredentials | None = None) -> grpc.Channel:
    """A blocking channel to `target` with `credentials` (None: plaintext, no token)."""
    creds = credentials or ChannelCredentials()
    channel = (
        grpc.secure_channel(target, creds.ssl(), options=creds.options())
        if creds.uses_tls
        else grpc.insecure_channel(target)
    )
    if creds.token:
        channel = grpc.intercept_channel(channel, _BearerToken(creds.token))
    return channel


def open_aio_channel(target: str, credentials: ChannelCredentials | None = None) -> grpc.aio.Channel:
    creds = credentials or ChannelCredentials()
    interceptors = [_AioBearerUnary(creds.token), _AioBearerStream(creds.token)] if creds.token else None
    if creds.uses_tls:
        return grpc.aio.secure_channel(target, creds.ssl(), options=creds.options(), interceptors=interceptors)
    return grpc.aio.insecure_channel(target, interceptors=interceptors)


def _with_token(details: Any, token: str) -> Any:
    metadata = [*(details.metadata or ()), ("authorization", f"Bearer {token}")]
    return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)


class _Details(
    collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    def __new__(cls, details: Any, metadata: list) -> _Details:
        return super().__new__(
            cls,
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_token(details, self._token), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_token(details, self._token), request)


class _AioBearerUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str | None) -> None:
        self._token = token or ""

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_aio_token(details, self._token), request)


class _AioBearerStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str | None) -> None:
        self._token = token or ""

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_aio_token(details, self._token), request)


def _with_aio_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), ("authorization", f"Bearer {token}"))
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


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

    def __init__(
        self, target: str, *, credentials: ChannelCredentials | None = None, channel: grpc.Channel | None = None
    ) -> None:
        self.target = target
        self._channel = channel or open_channel(target, credentials)
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

    def health_problem(self, timeout_s: float = 2.0) -> str:
        """Why the server does not serve, in a few words ("" when it does): its health, or
        why it cannot be reached ("connection refused", ...)."""
        try:
            status = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"
        if status.status == health_pb2.HealthCheckResponse.SERVING:
            return ""
        return "it answers but does not serve yet (NOT_SERVING: its engine is starting, or it shuts down)"

    def generate(self, prompt: Prompt, *, timeout_s: float | None = None, **kw: Any) -> inference_pb2.GenerateResponse:
        return self.inference.Generate(generate_request(prompt, **kw), timeout=timeout_s)

    def stream(self, prompt: Prompt, *, timeout_s: float | None = None, **kw: Any) -> ResponseStream:
        return self.inference.GenerateStream(generate_request(prompt, **kw), timeout=timeout_s)

    def abort(self, *request_ids: str) -> None:
        self.control.Abort(control_pb2.AbortRequest(request_ids=request_ids))

    def server_info(self) -> control_pb2.ServerInfo:
        return self.control.GetServerInfo(control_pb2.GetServerInfoRequest())

    def model_info(self) -> control_pb2.ModelInfo:
        return self.control.GetModelInfo(control_pb2.GetModelInfoRequest())


class AsyncClient:
    """asyncio client: `async with AsyncClient(target) as c: r = await c.generate("Hi")`."""

    def __init__(
        self, target: str, *, credentials: ChannelCredentials | None = None, channel: grpc.aio.Channel | None = None
    ) -> None:
        self.target = target
        self._channel = channel or open_aio_channel(target, credentials)
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
