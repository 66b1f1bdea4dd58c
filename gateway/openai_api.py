"""OpenAI-compatible REST API (FastAPI): completions, chat completions, responses (and their
stored ones: retrieve, delete, input items), embeddings, models, health, metrics, and vLLM's
score / rerank over embeddings (gateway/scoring.py), tokenize / detokenize and runtime LoRA
adapter loading (gateway/lora_admin.py).

Bodies are read and parsed here, not by FastAPI, so every client error has an OpenAI-shaped
body and the right status: size (413, by Content-Length and by bytes actually received),
UTF-8 and JSON (400), field types (400 naming the field), unknown model (404), auth (401).
A client disconnect cancels the request's downstream gRPC calls (stream or not). A 429 (load
shed: this gateway's `--max-concurrent-requests`, or every worker of a pool full) carries
`Retry-After: 1`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import importlib.metadata
import json
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from engine_api.beam_search import BeamSearchParams, BeamSequence
from gateway.beam_search import beam_body, beam_params, ignored_fields, run_beam_search
from gateway.chat_tools import chat_finish_reason, chat_job, chat_outputs
from gateway.embeddings import embedding_job, refuse_classifier_embeddings, run_embeddings
from gateway.errors import GatewayError
from gateway.lora_admin import check_allowed, load_adapter, unload_adapter
from gateway.model_resolution import resolve_model
from gateway.openai_protocol import (
    ChatCompletionRequest,
    ClassifyRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    PromptInput,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    chat_logprobs,
    chat_messages,
    completion_logprobs,
    echo_logprobs,
    embeddings_body,
    error_body,
    logprob_rows,
    parse_request,
    prompt_inputs,
    prompt_logprobs_entries,
    usage_dict,
)
from gateway.orchestrator import (
    Event,
    Finished,
    GenerationJob,
    TokenDelta,
    checked_cache_salt,
    usage_totals,
)
from gateway.reasoning import ChatOutput
from gateway.response_store import StoredResponse
from gateway.responses_api import (
    ResponsesPaths,
    ResponsesRequest,
    ResponseWriter,
    input_item_page,
    response_not_found,
)
from gateway.scoring import classify_body, rerank_body, score_body
from gateway.state import GatewayState
from gateway.tools import (
    ToolCalling,
    template_tools_from_request,
    tool_calling_from_request,
)
from protos.splitserve.v1 import common_pb2

T = TypeVar("T")


def _package_version() -> str:
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing
        return "unknown"


_VERSION = _package_version()


def build_app(state: GatewayState) -> FastAPI:
    """The FastAPI app of one gateway."""
    app = FastAPI(title="splitserve gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(GatewayError, _gateway_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)  # type: ignore[arg-type]

    @app.get("/health")
    async def health() -> Response:
        ok = state.healthy
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.CONTENT_TYPE)

    def model_cards() -> list[dict[str, Any]]:
        """The base model's card, then each LoRA adapter's the workers serve (as vLLM lists
        them: their parent is the base model)."""
        base = state.config.served_model_name
        card = {"object": "model", "created": state.created, "owned_by": "splitserve",
                "max_model_len": state.config.max_model_len}
        return [{"id": base, **card, "root": base, "parent": None},
                *({"id": name, **card, "root": name, "parent": base}
                  for name in sorted(state.lora_adapters()))]

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        _check_auth(request, state)
        return JSONResponse({"object": "list", "data": model_cards()})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        """OpenAI's retrieve (`client.models.retrieve`): one card, or a 404."""
        _check_auth(request, state)
        for card in model_cards():
            if card["id"] == model_id:
                return JSONResponse(card)
        raise GatewayError(grpc.StatusCode.NOT_FOUND, f"The model `{model_id[:200]}` does not "
                           "exist", param="model", error_code="model_not_found")

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": _VERSION})

    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness probe: /health's answer."""
        return await health()

    app.add_api_route("/ping", ping, methods=["GET", "POST"])

    @app.get("/load")
    async def load(request: Request) -> Response:
        """vLLM's `/load`: the requests this gateway is serving now."""
        _check_auth(request, state)
        return JSONResponse({"server_load": state.limit.num_in_flight})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _read_json(request, state)
        req = parse_request(CompletionRequest, body)
        lora = await resolve_model(state, req.model)
        beam = beam_params(req.model_extra or {}, ignored_fields(
            req, echo=req.echo, logprobs=req.logprobs is not None), req.n,
            req.max_tokens or 1, req.ignore_eos, req.temperature)
        request_id, jobs, echoes = await _completion_jobs(req, state)
        salt = checked_cache_salt(req.cache_salt)
        jobs = [dataclasses.replace(j, lora_name=lora, priority=req.priority, cache_salt=salt)
                for j in jobs]
        if beam is not None:
            return await _beam_response(state, request, jobs, beam, request_id, chat=False,
                                        token_ids=req.return_token_ids)
        view = _View(request_id, "text_completion", state, jobs, req.include_usage,
                     req.continuous_usage, chat=False, num_top=req.logprobs or 0,
                     num_prompt_top=req.prompt_logprobs, echoes=echoes,
                     hide_output=req.max_tokens == 0, return_token_ids=req.return_token_ids,
                     tokens_as_ids=req.return_tokens_as_token_ids)
        return await _respond(view, request, "completions", req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _read_json(request, state)
        req = parse_request(ChatCompletionRequest, body)
        lora = await resolve_model(state, req.model)
        extra = req.model_extra or {}
        beam = beam_params(extra, ignored_fields(
            req, logprobs=req.logprobs, top_logprobs=req.top_logprobs, tools=extra.get("tools"),
            reasoning_parser=state.config.reasoning_parser), req.n, 1, req.ignore_eos,
            req.temperature)
        job, calling = await _chat_job(req, state)
        job = dataclasses.replace(job, lora_name=lora, priority=req.priority,
                                  cache_salt=checked_cache_salt(req.cache_salt))
        if beam is not None:
            return await _beam_response(state, request, [job], beam, job.request_id, chat=True,
                                        token_ids=req.return_token_ids)
        view = _View(job.request_id, "chat.completion", state, [job], req.include_usage,
                     req.continuous_usage, chat=True, num_top=req.top_logprobs or 0,
                     num_prompt_top=req.prompt_logprobs, tool_calling=calling,
                     stream=req.stream, return_token_ids=req.return_token_ids,
                     tokens_as_ids=req.return_tokens_as_token_ids)
        return await _respond(view, request, "chat", req.stream)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await _read_json(request, state)
        req = parse_request(EmbeddingRequest, body)
        lora = await resolve_model(state, req.model)
        refuse_classifier_embeddings(state)
        inputs = prompt_inputs(req.input, state.config.max_embedding_inputs, "input")
        job = await embedding_job(state, inputs, request_id=f"embd-{uuid.uuid4().hex}",
                                  lora_name=lora, priority=req.priority,
                                  dimensions=req.dimensions,
                                  normalize=req.normalize,
                                  truncate_prompt_tokens=req.truncate_prompt_tokens,
                                  cache_salt=checked_cache_salt(req.cache_salt))
        state.metrics.requests_received.labels(api="embeddings").inc()
        state.metrics.prompt_tokens.inc(job.num_prompt_tokens)
        responses = await _until_disconnect(run_embeddings(state, job), request)
        return JSONResponse(embeddings_body([r.embedding for r in responses],
                                            job.num_prompt_tokens,
                                            lora or state.config.served_model_name,
                                            req.encoding_format))

    async def score(request: Request) -> Response:
        req = parse_request(ScoreRequest, await _read_json(request, state))
        lora = await resolve_model(state, req.model)
        return JSONResponse(await score_body(
            state, req, lora, lambda work: _until_disconnect(work, request)))

    async def classify(request: Request) -> Response:
        req = parse_request(ClassifyRequest, await _read_json(request, state))
        lora = await resolve_model(state, req.model)
        return JSONResponse(await classify_body(
            state, req, lora, lambda work: _until_disconnect(work, request)))

    async def rerank(request: Request) -> Response:
        req = parse_request(RerankRequest, await _read_json(request, state))
        lora = await resolve_model(state, req.model)
        return JSONResponse(await rerank_body(
            state, req, lora, lambda work: _until_disconnect(work, request)))

    for path in ("/v1/score", "/score"):  # vLLM serves both
        app.add_api_route(path, score, methods=["POST"])
    for path in ("/v1/classify", "/classify"):
        app.add_api_route(path, classify, methods=["POST"])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):  # Jina's and Cohere's paths
        app.add_api_route(path, rerank, methods=["POST"])

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await _read_json(request, state)
        req = parse_request(ResponsesRequest, body)
        lora = await resolve_model(state, req.model)
        previous = _previous_response(req, state)
        paths = ResponsesPaths()  # until the input is converted (its errors name its items)
        try:
            body, paths = req.chat_body(previous.conversation if previous else ())
            chat = parse_request(ChatCompletionRequest, body)
            if chat.n != 1:
                raise GatewayError.invalid("n", "n: a response has one output")
            job, calling = await _chat_job(chat, state)
            # `priority` (vLLM's Responses extra) came through as the chat body's.
            job = dataclasses.replace(job, lora_name=lora, priority=chat.priority,
                                      cache_salt=checked_cache_salt(chat.cache_salt))
        except GatewayError as err:  # named as the request names the field (an input item)
            raise err.renamed(paths) from None
        view = _View(job.request_id, "chat.completion", state, [job], include_usage=False,
                     continuous_usage=False, chat=True, num_top=0, tool_calling=calling,
                     stream=req.stream)
        store = req.wants_store and state.responses.enabled
        writer = ResponseWriter(req, lora or state.config.served_model_name, store=store)
        keep: _Keep = (functools.partial(state.responses.put, input_items=req.input_items(),
                                         previous=previous) if store else _keep_nothing)
        state.metrics.requests_received.labels(api="responses").inc()
        state.metrics.prompt_tokens.inc(len(job.prompt_token_ids))
        if req.stream:
            return await _stream_response(view, writer, keep)
        final = await _complete(view, request)
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
        _check_auth(request, state)
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise GatewayError.invalid("stream", "stream: a stored response is retrieved "
                                                 "whole (responses do not run in the background)")
        return JSONResponse(_stored_response(response_id, state).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Response:
        _check_auth(request, state)
        if not state.responses.delete(response_id):
            raise response_not_found(response_id, storing=state.responses.enabled)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request) -> Response:
        _check_auth(request, state)
        items = _stored_response(response_id, state).input_items
        return JSONResponse(input_item_page(items, request.query_params))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse_request(TokenizeRequest, await _read_json(request, state))
        await resolve_model(state, req.model, load=False)
        pre = state.preprocessor
        if (req.prompt is None) == (req.messages is None):
            raise GatewayError.invalid("prompt", "send either prompt or messages")
        if req.messages is not None:
            ids = await pre.encode_chat(chat_messages(req.messages), tools=(
                template_tools_from_request(req.model_extra or {})),
                template_kwargs=req.chat_template_kwargs, chat_template=req.chat_template,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message)
        elif req.chat_template is not None:
            raise GatewayError.invalid("chat_template", "chat_template renders messages; a "
                                                        "prompt is tokenized as it is")
        else:
            ids = await pre.encode_text(req.prompt or "", "prompt", req.add_special_tokens,
                                        allow_empty=True)
        return JSONResponse({"count": len(ids), "max_model_len": state.config.max_model_len,
                             "tokens": ids})

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        """vLLM's tokenizer description: what a client needs to tokenize as the server does
        (lm-eval's remote tokenizer reads it, then calls /tokenize and /detokenize)."""
        _check_auth(request, state)
        tok = state.tokenizer
        return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast",
                             **tok.special_tokens,
                             "add_bos_token": tok.add_bos_token,
                             # the template chat requests use: the gateway's, else the model's
                             "chat_template": state.config.chat_template or tok.chat_template,
                             "model_max_length": state.config.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse_request(DetokenizeRequest, await _read_json(request, state))
        await resolve_model(state, req.model, load=False)
        ids = state.preprocessor.check_token_ids(req.tokens, "tokens")
        return JSONResponse({"prompt": state.tokenizer.decode(ids, skip_special_tokens=False)})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's: the adapter loaded on every worker (or on none), then listed and routed."""
        _check_auth(request, state)
        check_allowed(state.config)  # before the body: off, nothing of it matters
        req = parse_request(LoadLoRAAdapterRequest, await _read_json(request, state))
        if req.load_inplace:
            raise GatewayError.invalid("load_inplace", "load_inplace is not supported: unload "
                                                       "the adapter, then load it again")
        await load_adapter(state, req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        """vLLM's: the adapter unloaded from every worker (or from none, while in use)."""
        _check_auth(request, state)
        check_allowed(state.config)
        req = parse_request(UnloadLoRAAdapterRequest, await _read_json(request, state))
        await unload_adapter(state, req.lora_name)
        return PlainTextResponse(
            f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return app


async def _beam_response(state: GatewayState, request: Request, jobs: list[GenerationJob],
                         params: BeamSearchParams, request_id: str, chat: bool,
                         token_ids: bool = False) -> Response:
    """`use_beam_search`: each job searched in turn (gateway/beam_search.py), one JSON body."""
    state.metrics.requests_received.labels(api="chat" if chat else "completions").inc()
    state.metrics.prompt_tokens.inc(sum(len(j.prompt_token_ids) for j in jobs))

    async def search() -> list[list[BeamSequence]]:
        return [await run_beam_search(state, job, dataclasses.replace(
                    params, max_tokens=job.sampling.max_tokens)) for job in jobs]

    results = await _until_disconnect(search(), request)
    return JSONResponse(beam_body(request_id, chat,
                                  jobs[0].lora_name or state.config.served_model_name, results,
                                  token_ids))


async def _respond(view: _View, request: Request, api: str, stream: bool) -> Response:
    """Count the accepted request, then answer it as SSE or as one JSON body."""
    view.state.metrics.requests_received.labels(api=api).inc()
    view.state.metrics.prompt_tokens.inc(sum(len(j.prompt_token_ids) for j in view.jobs))
    if stream:
        return await _stream(view, request)
    return JSONResponse(await _complete(view, request))


# -- stored responses ---------------------------------------------------------------------------
_Keep = Callable[[dict[str, Any]], object]  # stores a finished response (or not)


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


# -- request reading ----------------------------------------------------------------------------
def _check_auth(request: Request, state: GatewayState) -> None:
    key = state.config.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise GatewayError(grpc.StatusCode.UNAUTHENTICATED,
                           "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           error_code="invalid_api_key")


async def _read_json(request: Request, state: GatewayState) -> dict[str, Any]:
    """Auth, then the body: size-limited, strict UTF-8, a JSON object."""
    _check_auth(request, state)
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
    if not isinstance(obj, dict):
        raise GatewayError.invalid(None, "request body must be a JSON object")
    return obj


def _too_large(size: int, limit: int) -> GatewayError:
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"request body is {size} bytes or more; the limit is {limit} bytes",
                        http=413, error_code="request_too_large")


async def _completion_jobs(req: CompletionRequest, state: GatewayState
                           ) -> tuple[str, list[GenerationJob], list[str] | None]:
    """(the response's id, one job per prompt of the request: a batch, several, the prompts'
    texts when they are echoed), all validated before any runs. A batch's jobs are
    `<id>-<i>`."""
    req.check_supported()
    if req.best_of is not None and req.best_of != req.n:
        raise GatewayError.invalid("best_of", "best_of is not supported (it must equal n)")
    max_tokens = req.max_tokens
    if max_tokens == 0:
        if not req.echo:
            raise GatewayError.invalid("max_tokens", "max_tokens must be at least 1 (0 only "
                                                     "with echo=true: the prompt alone)")
        max_tokens = 1  # the prompt is scored with the first token, which is not shown
    if req.stream and req.echo and req.logprobs is not None and req.n > 1:
        # Completion 0 scores the prompt; the others' first chunks could come before it.
        raise GatewayError.invalid("n", "a stream that echoes the prompt with logprobs takes "
                                        "n = 1 (send the request once per completion, or "
                                        "without stream)")
    prompts = prompt_inputs(req.prompt, state.config.max_prompts_per_request)
    pre = state.preprocessor
    options = req.sampling_options(state.config.defaults) | {
        "max_tokens": max_tokens, "logprobs": req.logprobs,
                                        "prompt_logprobs": req.prompt_scoring()}
    request_id = f"cmpl-{uuid.uuid4().hex}"
    jobs: list[GenerationJob] = []
    echoes: list[str] | None = [] if req.echo else None
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        ids = (await pre.encode_text(prompt, param, req.add_special_tokens)
               if isinstance(prompt, str) else pre.check_token_ids(prompt, param))
        job = pre.build_job(ids, options, request_id=request_id if len(prompts) == 1
                            else f"{request_id}-{i}")
        jobs.append(job)
        if echoes is not None:
            echoes.append(_echo_text(prompt, len(ids), job, state))
    return request_id, jobs, echoes


def _echo_text(prompt: PromptInput, num_sent: int, job: GenerationJob,
               state: GatewayState) -> str:
    """The prompt an echo shows: as sent, or the text of the tokens the model saw when they
    are token ids or `truncate_prompt_tokens` cut them (the echoed logprobs score those)."""
    if isinstance(prompt, str) and len(job.prompt_token_ids) == num_sent:
        return prompt
    return state.tokenizer.decode(job.prompt_token_ids, skip_special_tokens=False)


async def _chat_job(req: ChatCompletionRequest, state: GatewayState
                    ) -> tuple[GenerationJob, ToolCalling | None]:
    req.check_supported()
    if req.top_logprobs is not None and not req.logprobs:
        raise GatewayError.invalid("top_logprobs", "top_logprobs requires logprobs=true")
    max_tokens, param = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    calling = tool_calling_from_request(req.model_extra or {}, state.config.tool_call_parser)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    options = req.sampling_options(state.config.defaults) | {"max_tokens": max_tokens,
                                                             "logprobs": logprobs}
    job = await chat_job(state, chat_messages(req.messages), options, calling,
                         request_id=f"chatcmpl-{uuid.uuid4().hex}",
                         param_names={"max_tokens": param, "logprobs": "top_logprobs"},
                         template_kwargs=_with_documents(req),
                         chat_template=req.chat_template,
                         add_generation_prompt=req.add_generation_prompt,
                         continue_final_message=req.continue_final_message,
                         add_special_tokens=req.add_special_tokens)
    return job, calling


def _with_documents(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The template's variables: `chat_template_kwargs`, and vLLM's `documents` (a RAG
    template's, as transformers passes them) unless the kwargs set their own."""
    if req.documents is None:
        return req.chat_template_kwargs
    return {"documents": req.documents, **(req.chat_template_kwargs or {})}


# -- responses ----------------------------------------------------------------------------------
@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    text_len: int = 0
    finished: Finished | None = None
    started: bool = False  # a delta of it was recorded (a stream echoes in the first)
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _View:
    """Renders one request's events as OpenAI completion or chat objects. `jobs`: one per
    prompt (a completions batch: several); their choices are numbered across them in order,
    as `Orchestrator.generate_batch` numbers the events.

    `echoes`: each job's prompt text, put before its choices' text (completions `echo`), with
    its scored tokens before their logprobs. `hide_output`: the completion's tokens are not
    shown (`max_tokens` 0 with echo: one token is generated to score the prompt).
    `num_prompt_top`: vLLM's `prompt_logprobs` asked for, with this many top entries.
    `tool_calling`: a chat request's tools; unless `tool_choice` is "none", each choice's text
    goes through a `ToolOutput` (content and tool calls). With the gateway's reasoning parser, a
    chat choice's `<think>` text is split off first (`gateway/reasoning.py`); each such choice's
    text goes through a `ChatOutput`."""

    id: str
    object: str
    state: GatewayState
    jobs: list[GenerationJob]
    include_usage: bool
    continuous_usage: bool
    chat: bool
    num_top: int
    num_prompt_top: int | None = None
    echoes: list[str] | None = None
    hide_output: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, _Choice] = field(default_factory=dict)
    wants_logprobs: bool = False
    job_of: list[int] = field(default_factory=list)  # choice index -> its job's index
    scored: dict[int, common_pb2.PromptLogprobs] = field(default_factory=dict)  # by job
    tool_calling: ToolCalling | None = None
    outputs: dict[int, ChatOutput] = field(default_factory=dict)  # by choice
    stream: bool = False  # streamed: `auto` tool calls stream their arguments as they come
    # vLLM's `return_token_ids`: prompt and output token ids in the response (and each delta's).
    return_token_ids: bool = False
    tokens_as_ids: bool = False  # vLLM's `return_tokens_as_token_ids`: "token_id:<id>" tokens

    def __post_init__(self) -> None:
        self.choices = {i: _Choice() for i in range(sum(j.n for j in self.jobs))}
        if self.chat:
            self.outputs = chat_outputs(self.state, self.jobs[0], self.tool_calling,
                                        len(self.choices), incremental=self.stream)
        self.wants_logprobs = self.jobs[0].wants_logprobs  # one sampling for the whole batch
        self.job_of = [j for j, job in enumerate(self.jobs) for _ in range(job.n)]

    def header(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created,
                # The model asked for: a LoRA adapter's name when one ran (as vLLM answers).
                "model": self.jobs[0].lora_name or self.state.config.served_model_name,
                "system_fingerprint": None}

    def _text_of(self, token_id: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.state.token_texts(token_id)

    def logprobs(self, lps: list[common_pb2.TokenLogprob], offset: int) -> dict[str, Any] | None:
        if not self.wants_logprobs:
            return None
        if self.chat:
            return chat_logprobs(lps, self._text_of, self.num_top)
        return completion_logprobs(logprob_rows(lps), self._text_of, offset)

    def echoed(self, index: int, text: str, lps: list[common_pb2.TokenLogprob]
               ) -> tuple[str, dict[str, Any] | None]:
        """Choice `index`'s text and logprobs with its prompt before them (echo; completions
        only: chat refuses it)."""
        if self.echoes is None:
            return text, self.logprobs(lps, 0)
        j = self.job_of[index]
        text = self.echoes[j] + text
        if not self.wants_logprobs:
            return text, None
        echo = echo_logprobs(self.jobs[j].prompt_token_ids,
                             self.scored.get(j, common_pb2.PromptLogprobs()), self._text_of,
                             self.num_top)
        end = echo["text_offset"][-1] + len(echo["tokens"][-1])
        return text, {key: echo[key] + value for key, value in
                      completion_logprobs(logprob_rows(lps), self._text_of, end).items()}

    def prompt_logprobs(self, index: int) -> list[Any] | None:
        """vLLM's `prompt_logprobs` of choice `index`'s prompt (None: not asked for)."""
        if self.num_prompt_top is None:
            return None
        return prompt_logprobs_entries(
            self.scored.get(self.job_of[index], common_pb2.PromptLogprobs()), self._text_of,
            self.num_prompt_top)

    def record(self, event: Event) -> None:
        choice = self.choices[event.index]
        if isinstance(event, TokenDelta):
            if event.prompt_logprobs is not None:
                self.scored[self.job_of[event.index]] = event.prompt_logprobs
            if not self.hide_output:
                choice.text.append(event.text)
                choice.logprobs.extend(event.logprobs)
                choice.num_tokens += len(event.token_ids)
                choice.token_ids.extend(event.token_ids)
                output = self.outputs.get(event.index)
                if output is not None:
                    output.note(event.text, event.token_ids)
        else:
            choice.finished = event

    def usage(self) -> dict[str, Any]:
        """Each prompt counted once (its n completions share it), completions summed."""
        prompt = cached = 0
        first = 0
        for job in self.jobs:
            mine = [self.choices[i].finished for i in range(first, first + job.n)]
            p, _, c = usage_totals([f for f in mine if f is not None])
            prompt += p or len(job.prompt_token_ids)
            cached += c
            first += job.n
        completion = sum(c.num_tokens for c in self.choices.values())
        usage = usage_dict(prompt, completion, cached)
        if self.chat and self.state.config.reasoning_parser is not None:
            held_back = bool(self.jobs[0].stop)  # a stop string may hold text back
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(
                out.reasoning_tokens(self.state.tokenizer, held_back)
                for out in self.outputs.values())}
        return usage

    # -- non-stream
    def final(self) -> dict[str, Any]:
        choices = []
        for index, c in sorted(self.choices.items()):
            text, logprobs = self.echoed(index, "".join(c.text), c.logprobs)
            f = c.finished
            item: dict[str, Any] = {"index": index, "logprobs": logprobs,
                                    "finish_reason": self._finish_reason(f),
                                    "stop_reason": f.stop_reason if f else None}
            if self.chat:
                item["message"] = {"role": "assistant", "content": text}
                output = self.outputs.get(index)
                if output is not None:
                    output.feed(text)
                    output.finish()
                    item["message"] = output.message()
                    item["finish_reason"] = self._parsed_finish_reason(f, output)
            else:
                item["text"] = text
                if self.num_prompt_top is not None:
                    item["prompt_logprobs"] = self.prompt_logprobs(index)
            if self.return_token_ids:
                item["token_ids"] = list(c.token_ids)
                if not self.chat:  # vLLM: each completion choice's own prompt
                    item["prompt_token_ids"] = self.prompt_ids(index)
            choices.append(item)
        out = self.header(self.object) | {"choices": choices, "usage": self.usage()}
        if self.chat and self.return_token_ids:  # vLLM: the response's, in chat
            out["prompt_token_ids"] = self.prompt_ids(0)
        if self.chat and self.num_prompt_top is not None:  # vLLM: the response's, in chat
            out["prompt_logprobs"] = self.prompt_logprobs(0)
        return out

    def prompt_ids(self, index: int) -> list[int]:
        """The prompt's token ids of choice `index` (its job's)."""
        return list(self.jobs[self.job_of[index]].prompt_token_ids)

    def _finish_reason(self, f: Finished | None) -> str | None:
        if f is None:
            return None
        # The prompt alone was asked for: its one scoring token ended it by length.
        return "length" if self.hide_output and f.finish_reason != "abort" else f.finish_reason

    def _parsed_finish_reason(self, f: Finished | None, output: ChatOutput) -> str | None:
        return chat_finish_reason(self._finish_reason(f), output)

    # -- stream
    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = self.header(self.object + (".chunk" if self.chat else "")) | {"choices": choices}
        if self.continuous_usage:
            out["usage"] = self.usage()
        return out

    def role_chunk(self, index: int) -> dict[str, Any]:
        out = self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": None}])
        if self.return_token_ids:  # vLLM: the prompt's ids come with the first chunk
            out["prompt_token_ids"] = self.prompt_ids(index)
        return out

    def event_chunk(self, event: Event) -> dict[str, Any] | None:
        """The chunk of a recorded event (None: nothing to send yet). A choice's first delta
        carries its echoed prompt, and completion 0's its prompt's `prompt_logprobs`."""
        choice = self.choices[event.index]
        output = self.outputs.get(event.index)
        if output is not None:
            return self._parsed_chunk(event, output)
        extra: dict[str, Any] = {}
        if isinstance(event, TokenDelta):
            first, choice.started = not choice.started, True
            text = "" if self.hide_output else event.text
            lps = [] if self.hide_output else event.logprobs
            if first and self.echoes is not None:
                text, logprobs = self.echoed(event.index, text, lps)
            else:
                logprobs = self.logprobs(lps, choice.text_len)
            choice.text_len += len(text)
            if event.prompt_logprobs is not None and self.num_prompt_top is not None:
                extra["prompt_logprobs"] = self.prompt_logprobs(event.index)
            ids = self._delta_ids(event)
            if first and self.return_token_ids and not self.chat:
                extra["prompt_token_ids"] = self.prompt_ids(event.index)
            if not text and not (lps and self.wants_logprobs) and not extra and not ids:
                return None  # text held back (possible stop string): nothing to send yet
            item: dict[str, Any] = {"index": event.index, "logprobs": logprobs,
                                    "finish_reason": None}
            if self.return_token_ids:
                item["token_ids"] = ids
        else:
            text = ""
            item = {"index": event.index, "logprobs": None,
                    "finish_reason": self._finish_reason(event),
                    "stop_reason": event.stop_reason}
        if self.chat:
            item["delta"] = {"content": text} if isinstance(event, TokenDelta) else {}
            return self.chunk([item]) | extra  # vLLM: the response's, in chat
        item["text"] = text
        return self.chunk([item | extra])

    def _delta_ids(self, event: TokenDelta) -> list[int]:
        """The delta's token ids to send (`return_token_ids`; none otherwise, or hidden)."""
        return list(event.token_ids) if self.return_token_ids and not self.hide_output else []

    def _parsed_chunk(self, event: Event, output: ChatOutput) -> dict[str, Any] | None:
        """A chat chunk of a choice whose text goes through the gateway's parsers: reasoning,
        content and tool-call deltas as they become known; what the end settles comes with the
        finish."""
        if isinstance(event, TokenDelta):
            delta = output.feed(event.text)
            logprobs = self.logprobs(event.logprobs, 0)
            ids = self._delta_ids(event)
            if not delta and not (event.logprobs and self.wants_logprobs) and not ids:
                return None
            item: dict[str, Any] = {"index": event.index, "logprobs": logprobs,
                                    "finish_reason": None}
            if self.return_token_ids:
                item["token_ids"] = ids
        else:
            delta = output.finish()
            item = {"index": event.index, "logprobs": None,
                    "finish_reason": self._parsed_finish_reason(event, output),
                    "stop_reason": event.stop_reason}
        body: dict[str, Any] = {}
        if delta.reasoning:
            body["reasoning"] = body["reasoning_content"] = delta.reasoning
        if delta.content:
            body["content"] = delta.content
        if delta.calls:
            body["tool_calls"] = delta.calls
        item["delta"] = body
        return self.chunk([item])

    def usage_chunk(self) -> dict[str, Any]:
        return self.header(self.object + (".chunk" if self.chat else "")) | {
            "choices": [], "usage": self.usage()}


async def _complete(view: _View, request: Request) -> dict[str, Any]:
    """Run to the end; a client disconnect cancels the generation (and the gRPC calls)."""
    async def consume() -> None:
        async for event in view.state.orchestrator.generate_batch(view.jobs):
            view.record(event)

    await _until_disconnect(consume(), request)
    return view.final()


async def _until_disconnect(work: Awaitable[T], request: Request) -> T:
    """`work`'s result (a GatewayError from the workers re-raised); a client disconnect first
    cancels it, and with it the gRPC calls it made."""
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
        raise GatewayError(grpc.StatusCode.CANCELLED, "client disconnected")
    return consumer.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _started(view: _View) -> tuple[Event, AsyncGenerator[Event, None]]:
    """The view's events with the first one awaited, so an early failure gets a real status."""
    events = view.state.orchestrator.generate_batch(view.jobs)
    try:
        return await anext(events), events
    except BaseException:
        await events.aclose()
        raise


class _EventStream(StreamingResponse):
    """SSE of a request's `events` rendered by `body`; both are closed when the response ends,
    however it ends. Starlette cancels the body on a client disconnect, but one cancelled while
    it waited on a send stays suspended (and one never started never ran its cleanup) until
    the garbage collector finalizes it; closing them here ends the request at once: its
    downstream calls cancelled, its place of the request limit given back."""

    def __init__(self, body: AsyncGenerator[str, None],
                 events: AsyncGenerator[Event, None]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._body = body
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()    # its own cleanup closes `events`, if it started
            await self._events.aclose()  # a no-op once closed


async def _stream(view: _View, request: Request) -> Response:
    """SSE of chat or completion chunks, ending `[DONE]`."""
    del request
    first, events = await _started(view)
    return _EventStream(_sse(view, first, events), events)


async def _sse(view: _View, first: Event, events: AsyncGenerator[Event, None]
               ) -> AsyncGenerator[str, None]:
    try:
        if view.chat:
            for index in range(len(view.choices)):
                yield _data(view.role_chunk(index))
        event: Event | None = first
        while event is not None:
            view.record(event)
            chunk = view.event_chunk(event)
            if chunk is not None:
                yield _data(chunk)
            event = await anext(events, None)
        if view.include_usage:
            yield _data(view.usage_chunk())
    except GatewayError as err:
        yield _data(error_body(err.message, _error_type(err.http_status), err.param,
                               err.error_code or err.http_status))
    finally:
        await events.aclose()
    yield "data: [DONE]\n\n"


async def _stream_response(view: _View, writer: ResponseWriter, keep: _Keep) -> Response:
    """The Responses API's SSE stream: typed events, no [DONE]."""
    first, events = await _started(view)
    return _EventStream(_response_events(view, writer, first, events, keep), events)


async def _response_events(view: _View, writer: ResponseWriter, first: Event,
                           events: AsyncGenerator[Event, None], keep: _Keep
                           ) -> AsyncGenerator[str, None]:
    """The stream's events; the finished response is kept (`keep`) before its last event goes
    out, so a client that has it can retrieve it at once. A failed or cut stream keeps none."""
    finish_reason: str | None = None
    try:
        for e in writer.start():
            yield _typed(e)
        event: Event | None = first
        while event is not None:
            view.record(event)
            chunk = view.event_chunk(event)
            for choice in (chunk or {}).get("choices", []):
                for e in writer.delta(choice.get("delta") or {}):
                    yield _typed(e)
                finish_reason = choice.get("finish_reason") or finish_reason
            event = await anext(events, None)
        closing = writer.finish(finish_reason, view.usage())
        keep(writer.response)
        for e in closing:
            yield _typed(e)
    except GatewayError as err:
        err = err.renamed(ResponsesPaths())
        yield _typed(writer.error(err.message, err.error_code or err.http_status, err.param))
    finally:
        await events.aclose()


def _typed(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\n{_data(event)}"


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# -- errors ------------------------------------------------------------------------------------
def _error_type(status: int) -> str:
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
    return JSONResponse(error_body(message, _error_type(status), param, code), status_code=status,
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
