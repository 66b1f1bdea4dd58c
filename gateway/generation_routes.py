"""The generation and pooling routes: completions, chat completions (either may run a beam
search), embeddings, and vLLM's score / classify / rerank (gateway/scoring.py)."""

from __future__ import annotations

import dataclasses
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine_api.beam_search import BeamSearchParams, BeamSequence
from gateway.beam_search import beam_body, beam_params, ignored_fields, run_beam_search
from gateway.completion_view import CompletionView
from gateway.embeddings import embedding_job, refuse_classifier_embeddings, run_embeddings
from gateway.generation import GenerationJob, checked_cache_salt
from gateway.http_request import read_json, until_disconnect
from gateway.model_resolution import resolve_model
from gateway.openai_bodies import embeddings_body
from gateway.openai_jobs import chat_completion_job, completion_jobs
from gateway.openai_protocol import (
    ChatCompletionRequest,
    ClassifyRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    parse_request,
    prompt_inputs,
)
from gateway.scoring import classify_body, rerank_body, score_body
from gateway.state import GatewayState
from gateway.streaming import complete, stream_chunks


def add_generation_routes(app: FastAPI, state: GatewayState) -> None:
    """Completions, chat completions, embeddings, score, classify and rerank."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request, state)
        req = parse_request(CompletionRequest, body)
        lora = await resolve_model(state, req.model)
        beam = beam_params(req.model_extra or {}, ignored_fields(
            req, echo=req.echo, logprobs=req.logprobs is not None), req.n,
            req.max_tokens or 1, req.ignore_eos, req.temperature)
        request_id, jobs, echoes = await completion_jobs(req, state)
        salt = checked_cache_salt(req.cache_salt)
        jobs = [dataclasses.replace(j, lora_name=lora, priority=req.priority, cache_salt=salt)
                for j in jobs]
        if beam is not None:
            return await _beam_response(state, request, jobs, beam, request_id, chat=False,
                                        token_ids=req.return_token_ids)
        view = CompletionView(request_id, "text_completion", state, jobs, req.include_usage,
                              req.continuous_usage, chat=False, num_top=req.logprobs or 0,
                              num_prompt_top=req.prompt_logprobs, echoes=echoes,
                              hide_output=req.max_tokens == 0,
                              return_token_ids=req.return_token_ids,
                              tokens_as_ids=req.return_tokens_as_token_ids)
        return await _respond(view, request, "completions", req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, state)
        req = parse_request(ChatCompletionRequest, body)
        lora = await resolve_model(state, req.model)
        extra = req.model_extra or {}
        beam = beam_params(extra, ignored_fields(
            req, logprobs=req.logprobs, top_logprobs=req.top_logprobs, tools=extra.get("tools"),
            reasoning_parser=state.config.reasoning_parser), req.n, 1, req.ignore_eos,
            req.temperature)
        job, calling = await chat_completion_job(req, state)
        job = dataclasses.replace(job, lora_name=lora, priority=req.priority,
                                  cache_salt=checked_cache_salt(req.cache_salt))
        if beam is not None:
            return await _beam_response(state, request, [job], beam, job.request_id, chat=True,
                                        token_ids=req.return_token_ids)
        view = CompletionView(job.request_id, "chat.completion", state, [job], req.include_usage,
                              req.continuous_usage, chat=True, num_top=req.top_logprobs or 0,
                              num_prompt_top=req.prompt_logprobs, tool_calling=calling,
                              stream=req.stream, return_token_ids=req.return_token_ids,
                              tokens_as_ids=req.return_tokens_as_token_ids)
        return await _respond(view, request, "chat", req.stream)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await read_json(request, state)
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
        responses = await until_disconnect(run_embeddings(state, job), request,
                                           state.metrics)
        return JSONResponse(embeddings_body([r.embedding for r in responses],
                                            job.num_prompt_tokens,
                                            lora or state.config.served_model_name,
                                            req.encoding_format))

    async def score(request: Request) -> Response:
        req = parse_request(ScoreRequest, await read_json(request, state))
        lora = await resolve_model(state, req.model)
        return JSONResponse(await score_body(
            state, req, lora, lambda work: until_disconnect(work, request, state.metrics)))

    async def classify(request: Request) -> Response:
        req = parse_request(ClassifyRequest, await read_json(request, state))
        lora = await resolve_model(state, req.model)
        return JSONResponse(await classify_body(
            state, req, lora, lambda work: until_disconnect(work, request, state.metrics)))

    async def rerank(request: Request) -> Response:
        req = parse_request(RerankRequest, await read_json(request, state))
        lora = await resolve_model(state, req.model)
        return JSONResponse(await rerank_body(
            state, req, lora, lambda work: until_disconnect(work, request, state.metrics)))

    for path in ("/v1/score", "/score"):  # vLLM serves both
        app.add_api_route(path, score, methods=["POST"])
    for path in ("/v1/classify", "/classify"):
        app.add_api_route(path, classify, methods=["POST"])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):  # Jina's and Cohere's paths
        app.add_api_route(path, rerank, methods=["POST"])


async def _beam_response(state: GatewayState, request: Request, jobs: list[GenerationJob],
                         params: BeamSearchParams, request_id: str, chat: bool,
                         token_ids: bool = False) -> Response:
    """`use_beam_search`: each job searched in turn (gateway/beam_search.py), one JSON body."""
    state.metrics.requests_received.labels(api="chat" if chat else "completions").inc()
    state.metrics.prompt_tokens.inc(sum(len(j.prompt_token_ids) for j in jobs))

    async def search() -> list[list[BeamSequence]]:
        return [await run_beam_search(state, job, dataclasses.replace(
                    params, max_tokens=job.sampling.max_tokens)) for job in jobs]

    results = await until_disconnect(search(), request, state.metrics)
    return JSONResponse(beam_body(request_id, chat,
                                  jobs[0].lora_name or state.config.served_model_name, results,
                                  token_ids))


async def _respond(view: CompletionView, request: Request, api: str, stream: bool) -> Response:
    """Count the accepted request, then answer it as SSE or as one JSON body."""
    view.state.metrics.requests_received.labels(api=api).inc()
    view.state.metrics.prompt_tokens.inc(sum(len(j.prompt_token_ids) for j in view.jobs))
    if stream:
        return await stream_chunks(view, request)
    return JSONResponse(await complete(view, request))
