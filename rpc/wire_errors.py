"""Requests whose bytes are not their message: INVALID_ARGUMENT, not UNKNOWN.

grpc.aio parses a request before the servicer runs; a `DecodeError` there reaches the client
as UNKNOWN ("Unexpected DecodeError") and logs a traceback per call, so random or truncated
bytes look like a server fault and flood the log. `MalformedRequestInterceptor` parses them
itself and answers INVALID_ARGUMENT naming the message type. Unary requests only (the
services' calls are unary-unary and unary-stream); other handlers pass unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Malformed:
    """What the tolerant deserializer returns for bytes that do not parse."""

    def __init__(self, error: DecodeError) -> None:
        self.message = f"malformed request: {error}"


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _tolerant(handler)


def _tolerant(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    deserialize = handler.request_deserializer

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as e:
            return _Malformed(e)

    kwargs = {"request_deserializer": parse, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def unary_call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_call, **kwargs)
    if handler.unary_stream is not None:
        stream = handler.unary_stream

        async def stream_call(request: Any, context: grpc.aio.ServicerContext
                              ) -> AsyncIterator[Any]:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(stream_call, **kwargs)
    return handler
