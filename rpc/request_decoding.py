"""A request that is not a valid protobuf message of its method's type is the caller's error:
INVALID_ARGUMENT, not the UNKNOWN (with a DecodeError traceback in the server's log) that gRPC's
own deserialization failure gives.

`DecodeErrorInterceptor` hands each unary-request handler the raw bytes and parses them itself,
so a parse failure can end the call with the right status before the servicer runs."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT to a unary request whose bytes do not parse (streaming-request
    methods are passed through unchanged: this project has none on its public ports)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = handler_call_details.method
        kwargs = {"request_deserializer": None,  # the raw bytes reach the wrappers below
                  "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await unary(await _parsed(parse, raw, method, context), context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
        if handler.unary_stream is not None:
            streaming = handler.unary_stream
            if not inspect.isasyncgenfunction(streaming):  # writes with context.write
                async def unary_writes(raw: bytes, context: grpc.aio.ServicerContext) -> None:
                    await streaming(await _parsed(parse, raw, method, context), context)

                return grpc.unary_stream_rpc_method_handler(unary_writes, **kwargs)

            async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext
                                   ) -> AsyncIterator[Any]:
                request = await _parsed(parse, raw, method, context)
                async for response in streaming(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
        return handler


async def _parsed(parse: Callable[[bytes], Any], raw: bytes, method: str,
                  context: grpc.aio.ServicerContext) -> Any:
    try:
        return parse(raw)
    except (DecodeError, RuntimeWarning, ValueError) as exc:  # ValueError: bad UTF-8 in a string
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request is not a valid {method.rsplit('/', 1)[-1]} message: "
                            f"{exc}")
        raise AssertionError("unreachable") from exc  # abort() raises
