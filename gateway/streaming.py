"""A request's generation events answered: run to the end (one body), or streamed as
server-sent events — chat and completion chunks ending `[DONE]`, or the Responses API's typed
events. A client disconnect, at any stage (a streamed request's prefill included), cancels the
generation, and with it the downstream gRPC calls; it is counted (`splitserve:requests_aborted`).
So does a client that stops reading a stream: a send blocked past `stream_send_timeout_s` cuts
it. The events are never held back for a slow client (the orchestrator's queue takes them as the
workers send them), so its workers finish and free their KV at their own pace; the gateway keeps
at most the request's own text until it is sent or the stream is cut."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from gateway.completion_view import CompletionView
from gateway.errors import GatewayError
from gateway.generation import Event
from gateway.http_errors import error_type
from gateway.http_request import until_disconnect
from gateway.openai_bodies import error_body
from gateway.response_writer import ResponseWriter
from gateway.responses_api import ResponsesPaths

log = logging.getLogger(__name__)
Keep = Callable[[dict[str, Any]], object]  # stores a finished response (or not)


async def complete(view: CompletionView, request: Request) -> dict[str, Any]:
    """Run to the end; a client disconnect cancels the generation (and the gRPC calls)."""
    async def consume() -> None:
        async for event in view.state.orchestrator.generate_batch(view.jobs):
            view.record(event)

    await until_disconnect(consume(), request, view.state.metrics)
    return view.final()


async def _started(view: CompletionView, request: Request
                   ) -> tuple[Event, AsyncGenerator[Event, None]]:
    """The view's events with the first one awaited, so an early failure gets a real status.
    The client may leave while it is awaited (a long prompt's prefill): that cancels the
    prefill at once, rather than when the first token finds nobody to send it to."""
    events = view.state.orchestrator.generate_batch(view.jobs)

    async def first() -> Event:
        return await anext(events)

    try:
        return await until_disconnect(first(), request, view.state.metrics), events
    except BaseException:
        await events.aclose()
        raise


class _ClientTooSlow(Exception):
    """A send to the client did not complete within the stream send timeout."""


class _EventStream(StreamingResponse):
    """SSE of a request's `events` rendered by `body`; both are closed when the response ends,
    however it ends. Starlette cancels the body on a client disconnect, but one cancelled while
    it waited on a send stays suspended (and one never started never ran its cleanup) until
    the garbage collector finalizes it; closing them here ends the request at once: its
    downstream calls cancelled, its place of the request limit given back."""

    def __init__(self, body: AsyncGenerator[str, None],
                 events: AsyncGenerator[Event, None], view: CompletionView) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._body = body
        self._events = events
        self._send_timeout_s = view.state.config.stream_send_timeout_s
        self._metrics = view.state.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            # A client that stopped reading blocks the send once its TCP window and the
            # server's buffer are full: past the timeout, the stream is cut (the events are
            # not buffered for it: the generation behind them is cancelled).
            try:
                await asyncio.wait_for(send(message), self._send_timeout_s)
            except TimeoutError:
                raise _ClientTooSlow from None

        try:
            await super().__call__(scope, receive, timed_send)
        except _ClientTooSlow:
            self._metrics.stream_send_timeouts.labels(api="rest").inc()
            log.warning("a streaming client took no data for %.0fs: stream cut",
                        self._send_timeout_s)
        finally:
            await self._body.aclose()    # its own cleanup closes `events`, if it started
            await self._events.aclose()  # a no-op once closed


async def stream_chunks(view: CompletionView, request: Request) -> Response:
    """SSE of chat or completion chunks, ending `[DONE]`."""
    first, events = await _started(view, request)
    return _EventStream(_sse(view, first, events), events, view)


async def _sse(view: CompletionView, first: Event, events: AsyncGenerator[Event, None]
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
        yield _data(error_body(err.message, error_type(err.http_status), err.param,
                               err.error_code or err.http_status))
    except (asyncio.CancelledError, GeneratorExit):  # the client left mid-stream
        view.state.metrics.requests_aborted.labels(api="rest").inc()
        raise
    finally:
        await events.aclose()
    yield "data: [DONE]\n\n"


async def stream_response(view: CompletionView, writer: ResponseWriter, keep: Keep,
                          request: Request) -> Response:
    """The Responses API's SSE stream: typed events, no [DONE]."""
    first, events = await _started(view, request)
    return _EventStream(_response_events(view, writer, first, events, keep), events, view)


async def _response_events(view: CompletionView, writer: ResponseWriter, first: Event,
                           events: AsyncGenerator[Event, None], keep: Keep
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
    except (asyncio.CancelledError, GeneratorExit):  # the client left mid-stream
        view.state.metrics.requests_aborted.labels(api="rest").inc()
        raise
    finally:
        await events.aclose()


def _typed(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\n{_data(event)}"


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
