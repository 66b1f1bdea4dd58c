"""`GET /openapi.json`: FastAPI's description of the REST API, with each POST route's request
body described by the request model it is parsed with (the routes read their bodies themselves,
gateway/http_request.py, so FastAPI alone would describe none). API fuzzers and client
generators start from it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from gateway.openai_protocol import (
    ChatCompletionRequest,
    ClassifyRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from gateway.responses_api import ResponsesRequest

# The model each POST route parses its body with (gateway/openai_protocol.py).
REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest,
    **{path: ScoreRequest for path in ("/v1/score", "/score")},
    **{path: ClassifyRequest for path in ("/v1/classify", "/classify")},
    **{path: RerankRequest for path in ("/v1/rerank", "/rerank", "/v2/rerank")},
}
_REF = "#/components/schemas/{model}"


def install_openapi(app: FastAPI, version: str) -> None:
    """Serve the app's OpenAPI document (made once, on the first request for it)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app, version)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document(app: FastAPI, version: str) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=version, routes=app.routes)
    schemas: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in REQUEST_MODELS.items():
        operation = doc.get("paths", {}).get(path, {}).get("post")
        if operation is None:
            continue
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=model.__name__)}}}}
    return doc
