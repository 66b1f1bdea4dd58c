"""OpenAI-shaped error bodies for the REST API: every error (the gateway's own, FastAPI's
validation, Starlette's 404/405) answers `{"error": {...}}` with the right status, and a 429
(load shed) carries `Retry-After`."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.errors import GatewayError
from gateway.openai_bodies import error_body


def add_error_handlers(app: FastAPI) -> None:
    """Answer the app's errors as OpenAI does."""
    app.add_exception_handler(GatewayError, _gateway_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)  # type: ignore[arg-type]


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


# A 429 is load shed (this gateway's bound, or every worker of a pool full): nothing was wrong
# with the request, and a second later there may be room (the openai client honours it).
_RETRY_AFTER_S = 1


def _error_response(status: int, message: str, param: str | None,
                    code: str | int | None) -> JSONResponse:
    headers = {"Retry-After": str(_RETRY_AFTER_S)} if status == 429 else None
    return JSONResponse(error_body(message, error_type(status), param, code), status_code=status,
                        headers=headers)


async def _gateway_error_handler(request: Request, err: GatewayError) -> JSONResponse:
    del request
    status = err.http_status
    return _error_response(status, err.message, err.param, err.error_code or status)


async def _validation_error_handler(request: Request, err: RequestValidationError) -> JSONResponse:
    del request
    first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
    field_name = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    return _error_response(400, f"{field_name or 'body'}: {first.get('msg')}", field_name, 400)


async def _http_error_handler(request: Request, err: StarletteHTTPException) -> JSONResponse:
    message = str(err.detail)
    if err.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif err.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    return _error_response(err.status_code, message, None, err.status_code)
