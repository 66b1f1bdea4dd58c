"""The Responses API's routes: create (a chat completion underneath, gateway/responses_api.py
converts both ways), and the stored responses' retrieve, delete and input items."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gateway.completion_view import CompletionView
from gateway.errors import GatewayError
from gateway.generation import checked_cache_salt
from gateway.http_request import check_auth, read_json
from gateway.model_resolution import resolve_model
from gateway.openai_jobs import chat_completion_job
from gateway.openai_protocol import ChatCompletionRequest, parse_request
from gateway.response_store import StoredResponse
from gateway.response_writer import ResponseWriter
from gateway.responses_api import (
    ResponsesPaths,
    ResponsesRequest,
    input_item_page,
    response_not_found,
)
from gateway.state import GatewayState
from gateway.streaming import Keep, complete, stream_response


def add_responses_routes(app: FastAPI, state: GatewayState) -> None:
    """POST /v1/responses, and GET / DELETE /v1/responses/{id} (and its input items)."""

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await read_json(request, state)
        req = parse_request(ResponsesRequest, body)
        lora = await resolve_model(state, req.model)
        previous = _previous_response(req, state)
        paths = ResponsesPaths()  # until the input is converted (its errors name its items)
        try:
            body, paths = req.chat_body(previous.conversation if previous else ())
            chat = parse_request(ChatCompletionRequest, body)
            if chat.n != 1:
                raise GatewayError.invalid("n", "n: a response has one output")
            job, calling = await chat_completion_job(chat, state)
            # `priority` (vLLM's Responses extra) came through as the chat body's.
            job = dataclasses.replace(job, lora_name=lora, priority=chat.priority,
                                      cache_salt=checked_cache_salt(chat.cache_salt))
        except GatewayError as err:  # named as the request names the field (an input item)
            raise err.renamed(paths) from None
        view = CompletionView(job.request_id, "chat.completion", state, [job], include_usage=False,
                              continuous_usage=False, chat=True, num_top=0, tool_calling=calling,
                              stream=req.stream)
        store = req.wants_store and state.responses.enabled
        writer = ResponseWriter(req, lora or state.config.served_model_name, store=store)
        keep: Keep = (functools.partial(state.responses.put, input_items=req.input_items(),
                                         previous=previous) if store else _keep_nothing)
        state.metrics.requests_received.labels(api="responses").inc()
        state.metrics.prompt_tokens.inc(len(job.prompt_token_ids))
        if req.stream:
            return await stream_response(view, writer, keep, request)
        final = await complete(view, request)
        choice = final["choices"][0]
        message = choice["message"]
        writer.delta({"reasoning": message.get("reasoning"), "content": message.get("content"),
                      "tool_calls": [{"index": i, **call} for i, call in
                                     enumerate(message.get("tool_calls") or [])]})
        writer.finish(choice["finish_reason"], final["usage"])
        keep(writer.response)
        return JSONResponse(writer.response)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> Response:
        check_auth(request, state)
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise GatewayError.invalid("stream", "stream: a stored response is retrieved "
                                                 "whole (responses do not run in the background)")
        return JSONResponse(_stored_response(response_id, state).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Response:
        check_auth(request, state)
        if not state.responses.delete(response_id):
            raise response_not_found(response_id, storing=state.responses.enabled)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request) -> Response:
        check_auth(request, state)
        items = _stored_response(response_id, state).input_items
        return JSONResponse(input_item_page(items, request.query_params))


def _keep_nothing(response: dict[str, Any]) -> None:
    del response


def _stored_response(response_id: str, state: GatewayState) -> StoredResponse:
    stored = state.responses.get(response_id)
    if stored is None:
        raise response_not_found(response_id, storing=state.responses.enabled)
    return stored


def _previous_response(req: ResponsesRequest, state: GatewayState) -> StoredResponse | None:
    """The stored response `previous_response_id` names (None: none named); 404 if unknown."""
    if req.previous_response_id is None:
        return None
    stored = state.responses.get(req.previous_response_id)
    if stored is None:
        raise response_not_found(req.previous_response_id, storing=state.responses.enabled,
                                 param="previous_response_id")
    return stored
