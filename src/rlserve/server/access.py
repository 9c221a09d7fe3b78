"""The one interceptor every call passes: it authenticates the caller, authorizes the method
by the table in `auth`, makes the caller known to the lifecycle audit for the call's
duration, and writes one JSON audit line for every mutation and every refused call.
Refused calls never reach a servicer, so they change nothing."""

from __future__ import annotations

import inspect
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import text_format
from google.protobuf.message import DecodeError

from rlserve.caller import CURRENT, Caller
from rlserve.server.auth import (
    PUBLIC,
    CertificateSubject,
    Credentials,
    CredentialSource,
    Listener,
    Role,
    printable,
    rule_for,
    served_here,
)

audit_log = logging.getLogger("rlserve.audit")

# Request fields shown in an audit line are cut here: payloads can be megabytes.
AUDIT_ARGS_CHARS = 256
Refusal = tuple[grpc.StatusCode, str]
NO_CREDENTIALS = Credentials((), {})


class AccessInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        *,
        listener: Listener,
        credentials: CredentialSource | None,
        client_certificates: bool,
        record: Callable[[str, str, str], None],
        observe: Callable[[str, str, float], None] = lambda method, code, seconds: None,
    ) -> None:
        """`record(operation, detail, outcome)` puts a refusal into the lifecycle audit ring;
        `observe(method, code, seconds)` sees every call (metrics)."""
        self._listener = listener
        self._credentials = credentials
        self._client_certificates = client_certificates
        self._record = record
        self._observe = observe

    @property
    def auth_enabled(self) -> bool:
        return self._credentials is not None or self._client_certificates

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or rule_for(details.method) == PUBLIC:
            return handler
        method = details.method
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                caller, started = await self._admit(method, request, context), time.perf_counter()
                try:
                    return await inner(request, context)
                finally:
                    self._done(method, caller, request, context, started)

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def generator_stream(request: Any, context: grpc.aio.ServicerContext):
                caller, started = await self._admit(method, request, context), time.perf_counter()
                try:
                    async for response in inner_stream(request, context):
                        yield response
                finally:
                    self._done(method, caller, request, context, started)

            async def writer_stream(request: Any, context: grpc.aio.ServicerContext) -> None:
                # A handler that writes its messages itself: nothing here runs per message.
                caller, started = await self._admit(method, request, context), time.perf_counter()
                try:
                    await inner_stream(request, context)
                finally:
                    self._done(method, caller, request, context, started)

            return grpc.unary_stream_rpc_method_handler(
                writer_stream if inspect.iscoroutinefunction(inner_stream) else generator_stream,
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler  # rlserve serves no client-streaming methods

    async def _admit(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Caller:
        caller, refusal = self._check(method, context)
        # The RPC's own task and context, so never reset (a stream its client abandons is
        # closed from another context).
        CURRENT.set(caller)
        if refusal is not None:
            code, message = refusal
            self._audit(method, caller, request, code, 0.0)
            self._record(method.rsplit("/", 1)[-1], message, code.name)
            self._observe(method, code.name, 0.0)
            await context.abort(code, message)
        if isinstance(request, Undecodable):
            self._observe(method, grpc.StatusCode.INVALID_ARGUMENT.name, 0.0)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a valid request for {method}: {request.error}")
        return caller

    def _check(self, method: str, context: grpc.aio.ServicerContext) -> tuple[Caller, Refusal | None]:
        peer = context.peer() or ""
        needed = rule_for(method)
        if not served_here(method, self._listener):
            where = "the control address" if self._listener is Listener.INFERENCE else "the inference address"
            return Caller("unknown", "", peer), (grpc.StatusCode.PERMISSION_DENIED, f"{method} is served on {where}")
        if not isinstance(needed, Role):  # a served method without a rule: refuse, loudly
            return Caller("unknown", "", peer), (grpc.StatusCode.PERMISSION_DENIED, f"no access rule for {method}")
        if not self.auth_enabled:
            return Caller("anonymous", "", peer), None
        grant, problem = self._authenticate(context)
        if grant is None:
            return Caller("unknown", "", peer), (grpc.StatusCode.UNAUTHENTICATED, problem)
        caller = Caller(grant.name, grant.role.value, peer)
        if not grant.role.allows(needed):
            message = f"{method} needs the {needed.value} role; {grant.name} has {grant.role.value}"
            return caller, (grpc.StatusCode.PERMISSION_DENIED, message)
        return caller, None

    def _authenticate(self, context: grpc.aio.ServicerContext):
        metadata = dict(context.invocation_metadata() or ())
        header = metadata.get("authorization")
        if header is not None:
            scheme, _, token = str(header).partition(" ")
            grant = None
            if scheme.lower() == "bearer" and self._credentials is not None:
                grant = self._credentials.current.for_token(token.strip())
            return grant, "the bearer token is not valid here"
        pem = (context.auth_context() or {}).get("x509_pem_cert", [])
        if pem:
            try:
                subject = CertificateSubject.from_pem(pem[0])
            except ValueError as e:
                return None, str(e)
            creds = self._credentials.current if self._credentials is not None else NO_CREDENTIALS
            name = printable(subject.common_name)
            return creds.for_certificate(subject), f"the client certificate '{name}' is not granted a role here"
        return (
            None,
            "this server needs a credential: call metadata 'authorization: Bearer TOKEN', or a client certificate",
        )

    def _done(
        self, method: str, caller: Caller, request: Any, context: grpc.aio.ServicerContext, started: float
    ) -> None:
        code = context.code() or grpc.StatusCode.OK
        if isinstance(code, int):  # set_code may store the raw number
            code = grpc.StatusCode(code)
        seconds = time.perf_counter() - started
        self._observe(method, code.name, seconds)
        if rule_for(method) is Role.ADMIN:
            self._audit(method, caller, request, code, seconds)

    @staticmethod
    def _audit(method: str, caller: Caller, request: Any, code: grpc.StatusCode, seconds: float) -> None:
        args = (
            str(request)
            if isinstance(request, Undecodable)
            else text_format.MessageToString(request, as_one_line=True, print_unknown_fields=False)
        )
        line = {
            "time": time.time(),
            "peer": caller.peer,
            "identity": caller.identity,
            "role": caller.role,
            "method": method,
            "args": args[:AUDIT_ARGS_CHARS],
            "outcome": code.name,
            "duration_ms": round(seconds * 1000, 3),
        }
        audit_log.info("%s", json.dumps(line))


class Undecodable:
    """A request whose bytes are no valid message (bad UTF-8 in a string, a corrupt length):
    answered INVALID_ARGUMENT once the caller is admitted; grpc's own answer is UNKNOWN."""

    def __init__(self, error: str) -> None:
        self.error = error

    def __str__(self) -> str:
        return f"<undecodable request: {self.error}>"


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except DecodeError as e:
            return Undecodable(str(e)[:200])

    return decode
