"""Reading a REST request: the API key, then the body, read here rather than by FastAPI so
every client error has an OpenAI-shaped body and the right status: size (413, by
Content-Length and by bytes actually received), UTF-8 and JSON (400), auth (401). And the
client's disconnect, which cancels the work done for it (its downstream gRPC calls)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

import grpc
from fastapi import Request

from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics
from gateway.state import GatewayState

T = TypeVar("T")

# Lists and objects a body may nest: far beyond what any API field takes (a JSON schema for
# structured outputs is the deepest, a few tens), and far below what recursive code after the
# parser (pydantic, json.dumps, the schema compiler) survives.
MAX_JSON_DEPTH = 128


def check_auth(request: Request, state: GatewayState) -> None:
    key = state.config.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise GatewayError(grpc.StatusCode.UNAUTHENTICATED,
                           "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           error_code="invalid_api_key")


async def read_json(request: Request, state: GatewayState) -> dict[str, Any]:
    """Auth, then the body: size-limited, strict UTF-8, a JSON object."""
    check_auth(request, state)
    limit = state.config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise GatewayError.invalid(None, f"invalid Content-Length header: {declared!r}")
        if int(declared) > limit:
            raise _too_large(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(len(body), limit)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise GatewayError.invalid(None, f"request body is not valid UTF-8 (byte {err.start})") from None
    if not text.strip():
        raise GatewayError.invalid(None, "request body is empty; expected a JSON object")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise GatewayError.invalid(None, f"request body is not valid JSON: {err}") from None
    except RecursionError:  # the C parser's own bound (~1,000 levels) on the nesting
        raise _too_deep() from None
    if not isinstance(obj, dict):
        raise GatewayError.invalid(None, "request body must be a JSON object")
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and json_depth(obj) > MAX_JSON_DEPTH:
        raise _too_deep()
    return obj


def json_depth(value: Any) -> int:
    """How deeply `value` nests lists and objects (a scalar: 0), walked without recursion
    (the point is to refuse what would overflow the recursive code that reads it later)."""
    depth = 0
    level = [value] if isinstance(value, (list, dict)) else []
    while level:
        depth += 1
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c)
                 if isinstance(v, (list, dict))]
    return depth


def _too_deep() -> GatewayError:
    return GatewayError.invalid(None, f"request body nests lists and objects more than "
                                      f"{MAX_JSON_DEPTH} deep")


def _too_large(size: int, limit: int) -> GatewayError:
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"request body is {size} bytes or more; the limit is {limit} bytes",
                        http=413, error_code="request_too_large")


async def until_disconnect(work: Awaitable[T], request: Request,
                           metrics: GatewayMetrics | None = None) -> T:
    """`work`'s result (a GatewayError from the workers re-raised); a client disconnect first
    cancels it, and with it the gRPC calls it made (counted in `metrics`' aborted requests)."""
    consumer = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (consumer, watcher):
            task.cancel()
    if not consumer.done() or consumer.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        if metrics is not None:
            metrics.requests_aborted.labels(api="rest").inc()
        raise GatewayError(grpc.StatusCode.CANCELLED, "client disconnected")
    return consumer.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
