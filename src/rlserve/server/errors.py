"""One table from domain errors to gRPC status codes, applied by one decorator per handler.

Servicers raise domain errors and never catch them; anything not in the table is a bug:
logged with its traceback and answered INTERNAL, and the server keeps serving.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc

from rlserve import errors

logger = logging.getLogger(__name__)

# One row per error family (`errors.KINDS`; a test checks every family has one).
STATUS_BY_KIND: dict[str, grpc.StatusCode] = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "capability": grpc.StatusCode.FAILED_PRECONDITION,
    "wrong_state": grpc.StatusCode.FAILED_PRECONDITION,
    "conflict": grpc.StatusCode.ABORTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "transfer_timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
    "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "not_allowed": grpc.StatusCode.PERMISSION_DENIED,
    "not_found": grpc.StatusCode.NOT_FOUND,
    # Not a client's mistake: a failed load, or a bug in rlserve.
    "commit_failed": grpc.StatusCode.INTERNAL,
    "prepare_failed": grpc.StatusCode.INTERNAL,
    "internal": grpc.StatusCode.INTERNAL,
}


def status_for(error: errors.RlserveError) -> grpc.StatusCode:
    return STATUS_BY_KIND.get(error.kind, grpc.StatusCode.INTERNAL)


async def _abort(context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
    if isinstance(error, errors.RlserveError):
        await context.abort(status_for(error), str(error))
    logger.exception("%s failed with an unexpected error", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"{method} failed: {type(error).__name__}: {error}")


def translate_errors(handler: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a unary or server-streaming grpc.aio handler so domain errors become statuses."""
    name = handler.__name__
    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext):
            try:
                async for response in handler(self, request, context):
                    yield response
            except Exception as e:  # noqa: BLE001 - the one place errors become statuses
                await _abort(context, name, e)

        return stream_wrapper

    @functools.wraps(handler)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext):
        try:
            return await handler(self, request, context)
        except Exception as e:  # noqa: BLE001 - the one place errors become statuses
            await _abort(context, name, e)

    return unary_wrapper
