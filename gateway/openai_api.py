"""OpenAI-compatible REST API (FastAPI): the app of one gateway, with its health, metrics,
version and ping routes and its OpenAPI document (`/openapi.json`, gateway/openapi.py); the
rest come from gateway/admin_routes.py (models, load, tokenize / detokenize, runtime LoRA
adapter loading), gateway/generation_routes.py (completions, chat
completions, embeddings, vLLM's score / classify / rerank) and gateway/responses_routes.py (the
Responses API and its stored responses).

Bodies are read and parsed by the routes, not by FastAPI (gateway/http_request.py), so every
client error has an OpenAI-shaped body (gateway/http_errors.py) and the right status: size
(413, by Content-Length and by bytes actually received), UTF-8 and JSON (400), field types
(400 naming the field), unknown model (404), auth (401). A client disconnect cancels the
request's downstream gRPC calls (stream or not). A 429 (load shed: this gateway's
`--max-concurrent-requests`, or every worker of a pool full) carries `Retry-After: 1`.
"""

from __future__ import annotations

import importlib.metadata

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from gateway.admin_routes import add_admin_routes
from gateway.generation_routes import add_generation_routes
from gateway.http_errors import add_error_handlers
from gateway.openapi import install_openapi
from gateway.responses_routes import add_responses_routes
from gateway.state import GatewayState
from gateway.trace_context import TraceContextMiddleware, telemetry_settings


def _package_version() -> str:
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing
        return "unknown"


_VERSION = _package_version()


def build_app(state: GatewayState) -> FastAPI:
    """The FastAPI app of one gateway."""
    # /openapi.json (gateway/openapi.py) but no interactive docs pages (they load scripts from
    # a CDN).
    app = FastAPI(title="splitserve gateway", version=_VERSION, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", **telemetry_settings())
    app.add_middleware(TraceContextMiddleware)
    add_error_handlers(app)
    install_openapi(app, _VERSION)

    @app.get("/health")
    async def health() -> Response:
        ok = state.healthy
        return JSONResponse({"status": "ok" if ok else "unavailable",
                             "serving_mode": state.orchestrator.modes.mode.value},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.CONTENT_TYPE)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": _VERSION})

    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness probe: /health's answer."""
        return await health()

    app.add_api_route("/ping", ping, methods=["GET"])
    app.add_api_route("/ping", ping, methods=["POST"], operation_id="ping_post")

    add_admin_routes(app, state)
    add_generation_routes(app, state)
    add_responses_routes(app, state)
    return app
