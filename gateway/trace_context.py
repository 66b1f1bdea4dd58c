"""REST requests join their client's trace, and probes and scrapes create none.

FastAPI (0.16x) traces requests itself: its server span, under the client's `traceparent`, is
current while a route runs, so the gateway's request span (started without an explicit parent)
becomes its child. `telemetry_settings` keeps that to /v1/* (not /health, /metrics, /ping).
Where FastAPI does not trace, `TraceContextMiddleware` makes the client's span current for
/v1/* requests instead."""

from __future__ import annotations

import inspect
from collections.abc import MutableMapping
from typing import Any

from fastapi import FastAPI
from opentelemetry import trace
from starlette.types import ASGIApp, Receive, Scope, Send

from rpc.tracing import remote_parent

TRACED_PREFIX = "/v1/"


def _untraced(scope: MutableMapping[str, Any]) -> bool:
    return not str(scope.get("path", "")).startswith(TRACED_PREFIX)


def telemetry_settings() -> dict[str, Any]:
    """FastAPI's keyword for its own tracing, limited to /v1/* (none for a FastAPI without
    it)."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"exclude": _untraced}}


class TraceContextMiddleware:
    """Pure ASGI (no task hop between it and the route), so a streamed body is produced
    inside the attached context too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or _untraced(scope)
                or trace.get_current_span().get_span_context().is_valid):  # FastAPI's span
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        with remote_parent(carrier):
            await self.app(scope, receive, send)
