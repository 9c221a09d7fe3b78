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

# Most specific class first: the first isinstance match wins.
STATUS_BY_ERROR: tuple[tuple[type[errors.RlserveError], grpc.StatusCode], ...] = (
    (errors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.CapabilityMissing, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.WrongState, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ConcurrentChange, grpc.StatusCode.ABORTED),
    (errors.EngineUnavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.TransferTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.NotAllowed, grpc.StatusCode.PERMISSION_DENIED),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
)


def status_for(error: errors.RlserveError) -> grpc.StatusCode:
    for cls, code in STATUS_BY_ERROR:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


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
