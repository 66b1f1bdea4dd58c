"""gRPC front door: `Gateway.Generate` and `Gateway.Embed` (gateway/embeddings.py, as REST's
/v1/embeddings) plus standard health and reflection services.

Validation failures end the call with INVALID_ARGUMENT and a message naming the field. A
failure after streaming began is sent in-band (`GenerateResponse.error`) and also ends the
call with its status; so does a request refused for load (RESOURCE_EXHAUSTED: the gateway's
`--max-concurrent-requests`, or every worker of a pool full). Cancelling the call cancels the
downstream prefill/decode calls.

Chat input is parsed as over REST (gateway/chat_tools.py, gateway/grpc_tools.py): with the
gateway's reasoning parser, or tools and a tool_choice other than none, each completion's text
goes through a `ChatOutput` (the `<think>` text split off, then the rest through a `ToolOutput`,
incremental as vLLM streams calls: an `auto` call is sent once its name is known, then its
arguments as they come); its chunks carry the reasoning as `reasoning`, the content as `text`
and the calls as `tool_calls` deltas (the token ids unchanged), and what the output's end
settles comes in a last chunk before the completion's `GenerateComplete`.
`chat_template_kwargs` reach the chat template, and a request's own `chat_template` replaces
it (with --trust-request-chat-template), checked as REST's.
`LoadLoRAAdapter` / `UnloadLoRAAdapter` are REST's /v1/load_lora_adapter and
/v1/unload_lora_adapter (gateway/lora_admin.py), under the same --allow-runtime-lora-updating.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Iterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine_api.beam_search import BeamSearchParams, BeamSequence
from gateway.beam_search import beam_params, run_beam_search
from gateway.chat_tools import chat_finish_reason, chat_job, chat_outputs
from gateway.config import GatewayConfig
from gateway.embeddings import embedding_job, refuse_classifier_embeddings, run_embeddings
from gateway.errors import GatewayError
from gateway.generation import Finished, GenerationJob, TokenDelta, checked_cache_salt
from gateway.grpc_tools import (
    call_deltas,
    chat_messages_from_proto,
    chat_template_from_proto,
    template_kwargs_from_proto,
    tool_calling_from_proto,
)
from gateway.lora_admin import load_adapter, unload_adapter
from gateway.model_resolution import resolve_model
from gateway.openai_protocol import ClassifyRequest, PromptInput, ScoreRequest
from gateway.reasoning import ChatOutput
from gateway.scoring import classify_body, score_body
from gateway.state import GatewayState
from gateway.structured import structured_from_proto
from gateway.tools import ToolCalling
from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from rpc import tracing
from rpc.auth import BearerAuthInterceptor
from rpc.health import HealthServicer
from rpc.limits import MAX_MESSAGE_BYTES
from rpc.request_decoding import DecodeErrorInterceptor
from rpc.servers import SERVER_OPTIONS, bind_port
from rpc.tls import read_pem

log = logging.getLogger(__name__)
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
_FINISH_ENUM = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
                "abort": common_pb2.FINISH_REASON_ABORT,
                "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS}


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Thin async servicer: validate → `GenerationJob` → stream orchestrator events."""

    def __init__(self, state: GatewayState) -> None:
        self._state = state

    async def Generate(  # type: ignore[override]  # writes with context.write, not yield
            self, request: gateway_pb2.GenerateRequest,
            context: grpc.aio.ServicerContext) -> None:
        # The request's span joins the client's trace (its `traceparent` metadata), if any.
        with tracing.remote_parent(tracing.metadata_carrier(context.invocation_metadata())):
            timeout_s = self._state.config.stream_send_timeout_s
            async with contextlib.aclosing(self._generate(request, context)) as responses:
                async for response in responses:
                    # A client that stopped reading blocks the write once its flow-control
                    # window is full: past the timeout the generation behind the responses is
                    # cancelled (their slot and downstream calls freed) before the call is
                    # ended: the status waits behind the unsent message, so the call itself
                    # lingers until the client reads or its deadline passes.
                    try:
                        await asyncio.wait_for(context.write(response), timeout_s)
                    except TimeoutError:
                        await responses.aclose()
                        metrics = self._state.metrics
                        metrics.stream_send_timeouts.labels(api="grpc").inc()
                        metrics.requests_aborted.labels(api="grpc").inc()
                        log.warning("a streaming gRPC client took no data for %.0fs: its "
                                    "generation cancelled", timeout_s)
                        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                            f"the client read nothing for {timeout_s:.0f}s")

    async def _generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        try:
            job, calling = await self._job(request)
            beam = _beam_search(request, job, self._state)
        except GatewayError as err:
            await context.abort(err.code, err.message)
        self._state.metrics.requests_received.labels(api="grpc").inc()
        self._state.metrics.prompt_tokens.inc(len(job.prompt_token_ids))
        if beam is not None:
            try:
                sequences = await run_beam_search(self._state, job, beam)
            except GatewayError as err:
                await context.abort(err.code, err.message)
            for event in _beam_events(sequences):
                yield _plain(event)
            return
        outputs: dict[int, ChatOutput] = {}
        if request.WhichOneof("input") == "chat":
            # A stream: reasoning and calls sent as they come.
            outputs = chat_outputs(self._state, job, calling, job.n, incremental=True)
        try:
            # Closed however the call ends (a cancelled call may leave it suspended at a yield):
            # its downstream calls are cancelled and its place of the request limit given back.
            async with contextlib.aclosing(self._state.orchestrator.generate(job)) as events:
                async for event in events:
                    for response in self._responses(event, outputs.get(event.index), job):
                        yield response
        except GatewayError as err:
            yield gateway_pb2.GenerateResponse(
                error=common_pb2.StreamError(code=err.code.value[0], message=err.message))
            await context.abort(err.code, err.message)
        except asyncio.CancelledError:  # the client cancelled (or left): at any stage
            self._state.metrics.requests_aborted.labels(api="grpc").inc()
            raise

    def _responses(self, event: TokenDelta | Finished, output: ChatOutput | None,
                   job: GenerationJob) -> Iterator[gateway_pb2.GenerateResponse]:
        """The responses of one event: as the engine produced it, or through its completion's
        parsers (`output`)."""
        if output is None:
            yield _plain(event)
            return
        for response in _parsed(event, output):
            if response.HasField("complete") and output.splitter is not None:
                response.complete.usage.reasoning_tokens = output.reasoning_tokens(
                    self._state.tokenizer, held_back=bool(job.stop))
            yield response

    async def Embed(self, request: gateway_pb2.EmbeddingsRequest,
                    context: grpc.aio.ServicerContext) -> gateway_pb2.EmbeddingsResponse:
        state = self._state
        try:
            lora = await _lora_of(state, request.model)
            refuse_classifier_embeddings(state)
            job = await embedding_job(
                state, _embedding_inputs(request, state.config.max_embedding_inputs),
                request_id=request.request_id or f"embd-{uuid.uuid4().hex}", lora_name=lora,
                priority=request.priority,
                dimensions=request.dimensions or None,
                normalize=request.normalize if request.HasField("normalize") else None,
                truncate_prompt_tokens=_truncation(request),
                pooling_type=request.pooling_type, param="inputs",
                cache_salt=checked_cache_salt(request.cache_salt or None))
        except GatewayError as err:
            await context.abort(err.code, err.message)
        state.metrics.requests_received.labels(api="grpc_embed").inc()
        state.metrics.prompt_tokens.inc(job.num_prompt_tokens)
        try:
            responses = await run_embeddings(state, job)
        except GatewayError as err:
            await context.abort(err.code, err.message)
        response = gateway_pb2.EmbeddingsResponse(
            data=[gateway_pb2.Embedding(embedding=r.embedding, prompt_tokens=r.num_prompt_tokens)
                  for r in responses], prompt_tokens=job.num_prompt_tokens)
        size = response.ByteSize()
        if size > MAX_MESSAGE_BYTES:  # a clear refusal rather than a broken call
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"{len(responses)} embeddings make a {size >> 20} MiB response; the limit is "
                f"{MAX_MESSAGE_BYTES >> 20} MiB: send fewer inputs (or fewer dimensions) per call"))
        return response

    async def Score(self, request: gateway_pb2.ScoreRequest,
                    context: grpc.aio.ServicerContext) -> gateway_pb2.ScoreResponse:
        state = self._state
        try:
            lora = await _lora_of(state, request.model)
            limit = state.config.max_embedding_inputs
            body = await score_body(state, ScoreRequest(
                text_1=_inputs(request.text_1, limit, "text_1"),
                text_2=_inputs(request.text_2, limit, "text_2"),
                priority=request.priority, truncate_prompt_tokens=_truncation(request)),
                lora, _as_is)
        except GatewayError as err:
            await context.abort(err.code, err.message)
        return gateway_pb2.ScoreResponse(scores=[d["score"] for d in body["data"]],
                                         prompt_tokens=body["usage"]["prompt_tokens"])

    async def Classify(self, request: gateway_pb2.ClassifyRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.ClassifyResponse:
        state = self._state
        try:
            lora = await _lora_of(state, request.model)
            body = await classify_body(state, ClassifyRequest(
                input=_inputs(request.inputs, state.config.max_embedding_inputs, "inputs"),
                priority=request.priority, truncate_prompt_tokens=_truncation(request)),
                lora, _as_is)
        except GatewayError as err:
            await context.abort(err.code, err.message)
        return gateway_pb2.ClassifyResponse(
            data=[gateway_pb2.Classification(label=d["label"], probs=d["probs"])
                  for d in body["data"]], prompt_tokens=body["usage"]["prompt_tokens"])

    async def LoadLoRAAdapter(self, request: common_pb2.LoadLoRAAdapterRequest,
                              context: grpc.aio.ServicerContext
                              ) -> common_pb2.LoadLoRAAdapterResponse:
        try:
            change = await load_adapter(self._state, request.lora_name, request.lora_path)
        except GatewayError as err:
            await context.abort(err.code, err.message)
        return common_pb2.LoadLoRAAdapterResponse(lora_adapters=change.lora_adapters)

    async def UnloadLoRAAdapter(self, request: common_pb2.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext
                                ) -> common_pb2.UnloadLoRAAdapterResponse:
        try:
            change = await unload_adapter(self._state, request.lora_name)
        except GatewayError as err:
            await context.abort(err.code, err.message)
        return common_pb2.UnloadLoRAAdapterResponse(lora_adapters=change.lora_adapters,
                                                    lora_path=change.lora_path)

    async def _job(self, request: gateway_pb2.GenerateRequest
                   ) -> tuple[GenerationJob, ToolCalling | None]:
        lora = await _lora_of(self._state, request.model)
        job, calling = await self._unrouted_job(request)
        return dataclasses.replace(job, lora_name=lora, priority=request.priority,
                                   cache_salt=checked_cache_salt(request.cache_salt or None)
                                   ), calling

    async def _unrouted_job(self, request: gateway_pb2.GenerateRequest
                            ) -> tuple[GenerationJob, ToolCalling | None]:
        state = self._state
        pre = state.preprocessor
        kind = request.WhichOneof("input")
        calling = tool_calling_from_proto(request, state.config.tool_call_parser)
        template_kwargs = template_kwargs_from_proto(request)
        chat_template = chat_template_from_proto(request)
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        if kind == "chat":
            messages = chat_messages_from_proto(request.chat.messages)
            options = _sampling_options(request, state.config.defaults)
            job = await chat_job(state, messages, options, calling,
                                 request_id=request_id, param="chat.messages",
                                 param_names=_PARAM_NAMES, template_kwargs=template_kwargs,
                                 chat_template=chat_template)
            return job, calling
        if kind == "text":
            ids = await pre.encode_text(request.text, "text")
        elif kind == "token_ids":
            ids = pre.check_token_ids(list(request.token_ids.ids), "token_ids.ids")
        else:
            raise GatewayError.invalid("input", "input is required: set one of text, token_ids, chat")
        return pre.build_job(ids, _sampling_options(request, state.config.defaults),
                             request_id=request_id,
                             param_names=_PARAM_NAMES), None


async def _lora_of(state: GatewayState, model: str) -> str:
    """The LoRA adapter a request's `model` names ("": the base model, or none named; loaded
    first when the gateway resolves adapters from a directory); NOT_FOUND for a model the
    workers do not serve (as over REST)."""
    return await resolve_model(state, model or None)


def _embedding_inputs(request: gateway_pb2.EmbeddingsRequest, limit: int) -> list[PromptInput]:
    """The request's inputs (text or token ids), at least one and at most `limit`."""
    return _inputs(request.inputs, limit, "inputs")


def _inputs(items: Sequence[gateway_pb2.EmbeddingInput], limit: int, param: str
            ) -> list[PromptInput]:
    """Inputs (text or token ids) named `param` in errors, at least one and at most `limit`."""
    if not items:
        raise GatewayError.invalid(param, f"{param} must not be empty")
    if len(items) > limit:
        raise GatewayError.invalid(param, f"{param}: at most {limit} per request, got "
                                          f"{len(items)}")
    out: list[PromptInput] = []
    for i, item in enumerate(items):
        kind = item.WhichOneof("input")
        if kind is None:
            raise GatewayError.invalid(f"{param}.{i}", f"{param}.{i}: set text or token_ids")
        out.append(item.text if kind == "text" else list(item.token_ids.ids))
    return out


async def _as_is(work: Awaitable[list[Any]]) -> list[Any]:
    """gRPC cancels the handler's task when the client goes: no watcher needed."""
    return await work


_PARAM_NAMES = {name: f"sampling.{name}" for name in (
    "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
    "stop_token_ids", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs",
    "logit_bias", "allowed_token_ids", "prompt_logprobs", "structured_outputs", "bad_words")}


def _sampling_options(request: gateway_pb2.GenerateRequest,
                      defaults: Mapping[str, float | int]) -> dict[str, object]:
    """Proto → engine `SamplingParams` kwargs. A field the client leaves unset (no presence
    for temperature, top_k and min_p; a documented zero for top_p, repetition_penalty and
    max_tokens) takes `defaults`' value (the model's generation config), else the neutral one:
    greedy for temperature, as this API has always read an unset temperature."""
    s = request.sampling
    top_k = (s.top_k if s.top_k > 0 else -1) if s.HasField("top_k") else defaults.get("top_k", -1)
    return {
        "n": request.n or 1,
        "temperature": (s.temperature if s.HasField("temperature")
                        else defaults.get("temperature", 0.0)),
        "top_p": s.top_p or defaults.get("top_p", 1.0),
        "top_k": top_k,
        "min_p": s.min_p if s.HasField("min_p") else defaults.get("min_p", 0.0),
        "seed": s.seed if s.HasField("seed") else None,
        "max_tokens": s.max_tokens or None,   # 0: the rest of the context (capped)
        "min_tokens": s.min_tokens,
        "stop": list(request.stop),
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "repetition_penalty": s.repetition_penalty or defaults.get("repetition_penalty", 1.0),
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "logprobs": s.logprobs if s.HasField("logprobs") else None,
        "prompt_logprobs": s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        "logit_bias": dict(s.logit_bias),
        "allowed_token_ids": list(s.allowed_token_ids) or None,
        "structured_outputs": structured_from_proto(s),
        "bad_words": list(s.bad_words),
        # Unset means vLLM's default, true (a plain proto3 bool would read false).
        "skip_special_tokens": (request.skip_special_tokens
                                if request.HasField("skip_special_tokens") else True),
        "truncate_prompt_tokens": _truncation(request),
    }


def _truncation(request: gateway_pb2.GenerateRequest | gateway_pb2.EmbeddingsRequest
                | gateway_pb2.ScoreRequest | gateway_pb2.ClassifyRequest) -> int | None:
    """`truncate_prompt_tokens` (unset: None, the whole prompt)."""
    return (request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens")
            else None)


def _beam_search(request: gateway_pb2.GenerateRequest, job: GenerationJob,
                 state: GatewayState) -> BeamSearchParams | None:
    """The request's beam search (None: not asked for); INVALID_ARGUMENT for the fields it
    would ignore."""
    s = request.sampling
    extra: dict[str, Any] = {"use_beam_search": request.use_beam_search}
    if request.HasField("length_penalty"):
        extra["length_penalty"] = request.length_penalty
    chat = request.WhichOneof("input") == "chat"
    fields: dict[str, object] = {
        "stop": list(request.stop), "sampling.stop_token_ids": list(s.stop_token_ids),
        "sampling.min_tokens": s.min_tokens, "sampling.presence_penalty": s.presence_penalty,
        "sampling.frequency_penalty": s.frequency_penalty,
        "sampling.repetition_penalty": s.repetition_penalty not in (0.0, 1.0),
        "sampling.logit_bias": dict(s.logit_bias),
        "sampling.allowed_token_ids": list(s.allowed_token_ids),
        "sampling.bad_words": list(s.bad_words), "sampling.logprobs": s.HasField("logprobs"),
        "sampling.prompt_logprobs": s.HasField("prompt_logprobs"),
        "sampling.structured_outputs": s.HasField("structured_outputs"),
        "tools": list(request.tools),
        "reasoning_parser": chat and state.config.reasoning_parser is not None}
    return beam_params(extra, fields, job.n, job.sampling.max_tokens, s.ignore_eos,
                       s.temperature if s.HasField("temperature") else None)


def _beam_events(sequences: list[BeamSequence]) -> Iterator[TokenDelta | Finished]:
    """Each sequence as one delta (all its tokens and text) and its finish, best first."""
    for index, seq in enumerate(sequences):
        yield TokenDelta(index, seq.output_token_ids, seq.text, [])
        yield Finished(index, seq.finish_reason or "length", None, seq.num_prompt_tokens,
                       len(seq.output_token_ids), 0)


def _plain(event: TokenDelta | Finished) -> gateway_pb2.GenerateResponse:
    """The response of one event as the engine produced it."""
    if isinstance(event, TokenDelta):
        return _chunk(event, event.text)
    return _complete(event, event.finish_reason)


def _parsed(event: TokenDelta | Finished, output: ChatOutput
            ) -> Iterator[gateway_pb2.GenerateResponse]:
    """The responses of one event through the completion's parsers: the chunks' text is its
    content, and the reasoning and the calls come as their own deltas; what the end settles
    comes in a last chunk."""
    if isinstance(event, TokenDelta):
        output.note(event.text, event.token_ids)
        delta = output.feed(event.text)
        yield _chunk(event, delta.content, delta.reasoning, call_deltas(delta.calls))
        return
    delta = output.finish()
    if delta:
        yield gateway_pb2.GenerateResponse(chunk=gateway_pb2.GenerateChunk(
            index=event.index, text=delta.content, reasoning=delta.reasoning,
            tool_calls=call_deltas(delta.calls)))
    yield _complete(event, chat_finish_reason(event.finish_reason, output) or event.finish_reason)


def _complete(event: Finished, reason: str) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(complete=gateway_pb2.GenerateComplete(
        index=event.index, finish_reason=_FINISH_ENUM[reason],
        usage=common_pb2.Usage(prompt_tokens=event.num_prompt_tokens,
                               completion_tokens=event.num_output_tokens,
                               cached_tokens=event.num_cached_tokens),
        stop_reason=event.stop_reason or ""))


def _chunk(event: TokenDelta, text: str, reasoning: str = "",
           tool_calls: list[gateway_pb2.ToolCallDelta] | None = None
           ) -> gateway_pb2.GenerateResponse:
    chunk = gateway_pb2.GenerateChunk(index=event.index, token_ids=event.token_ids, text=text,
                                      reasoning=reasoning, logprobs=event.logprobs,
                                      tool_calls=tool_calls)
    if event.prompt_logprobs is not None:
        chunk.prompt_logprobs.CopyFrom(event.prompt_logprobs)
    return gateway_pb2.GenerateResponse(chunk=chunk)


def public_credentials(config: GatewayConfig) -> grpc.ServerCredentials | None:
    """TLS credentials of the public gRPC port from the config's PEM files (None: plaintext);
    client certificates are required when `ssl_ca_certs` is set, as on the REST port."""
    if config.ssl_certfile is None or config.ssl_keyfile is None:
        return None
    key = read_pem(config.ssl_keyfile, "ssl_keyfile")
    chain = read_pem(config.ssl_certfile, "ssl_certfile")
    ca = None if config.ssl_ca_certs is None else read_pem(config.ssl_ca_certs, "ssl_ca_certs")
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca,
                                       require_client_auth=ca is not None)


class GrpcFrontend:
    """The grpc.aio server: Gateway + health (tracks decode-worker health) + reflection."""

    def __init__(self, state: GatewayState, host: str, port: int) -> None:
        self._state = state
        key = state.config.api_key
        # A request that does not parse is INVALID_ARGUMENT (after the key check).
        auth = [] if key is None else [BearerAuthInterceptor(key, "API key")]
        self.server = grpc.aio.server(options=list(SERVER_OPTIONS),
                                      interceptors=[*auth, DecodeErrorInterceptor()])
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(state), self.server)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = bind_port(self.server, address, public_credentials(state.config))
        self._tasks: set[asyncio.Task[None]] = set()
        state.router.decode.add_listener(self._schedule_health_update)

    async def start(self) -> None:
        await self.server.start()
        await self.update_health()

    async def update_health(self) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if self._state.healthy
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    def _schedule_health_update(self) -> None:
        task = asyncio.get_running_loop().create_task(self.update_health())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self, grace_s: float) -> None:
        """Flip health to NOT_SERVING, refuse new calls, drain in-flight ones for `grace_s`."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
