"""Online benchmark: an async streaming client against an OpenAI-compatible `/v1/completions`.

Each request sends the prompt as token ids with `stream: true`, `ignore_eos: true`,
`max_tokens` and `stream_options.include_usage`, and records the arrival time of every SSE
chunk that carries a choice. As in `vllm bench serve`, a chunk is one ITL sample even when it
carries several tokens (only TPOT divides by the token count), the output token count comes
from the final usage chunk, and E2E latency ends at the last token chunk.

With `endpoint="chat"` each request posts its prompt as text (the server's /detokenize of its
token ids) in one user message to `/v1/chat/completions`; a chunk counts when its delta carries
output (the first, role-only chunk does not), and the prompt's length is the server's count.

With `endpoint="embeddings"` (vLLM's `--backend openai-embeddings`) each request instead posts
its prompt's token ids to `/v1/embeddings` (base64, as the `openai` client asks by default): a
request's latency is its response's arrival, it produces no tokens, and its TTFT and E2E
latency are the same number.

Bounded by construction: only loopback targets unless `allow_remote`, a per-request timeout
and a total timeout after which unfinished requests are cancelled and counted as failed.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.metrics import RequestRecord
from bench.server_info import detokenize_all, vocabulary_sample
from bench.workloads import BenchRequest

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
ENDPOINTS = ("completions", "chat", "embeddings")


class RemoteHostError(ValueError):
    """The target is not a loopback host and remote targets were not allowed."""


class OnlineBenchError(RuntimeError):
    """The online benchmark could not run (e.g. no model name could be found)."""


def check_target(base_url: str, allow_remote: bool = False) -> str:
    """Validate `--base-url`; return it without a trailing slash."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteHostError(f"--base-url {base_url!r}: must be http(s)://HOST[:PORT]")
    if parts.hostname not in LOCAL_HOSTS and not allow_remote:
        raise RemoteHostError(
            f"--base-url {base_url!r}: host {parts.hostname!r} is not local "
            f"(allowed: {', '.join(sorted(LOCAL_HOSTS))}); pass --allow-remote to benchmark it"
        )
    return base_url.rstrip("/")


class SseParser:
    """Incremental Server-Sent-Events parser: bytes in, complete `data:` payloads out.

    Events end at a blank line; `:` lines are comments (keep-alive pings); several `data:`
    lines of one event are joined with newlines. Mutates its own buffer only.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""

    def feed(self, chunk: bytes) -> list[str]:
        # Normalise on the whole buffer: a "\r\n" may be split across two network reads.
        self._buffer = (self._buffer + self._decoder.decode(chunk)).replace("\r\n", "\n")
        payloads: list[str] = []
        while "\n\n" in self._buffer:
            event, self._buffer = self._buffer.split("\n\n", 1)
            data = [line[5:].removeprefix(" ") for line in event.split("\n")
                    if line.startswith("data:")]
            if data:
                payloads.append("\n".join(data))
        return payloads


@dataclass(slots=True)
class _StreamState:
    """What one request has seen so far."""

    token_times: list[float]
    output_tokens: int | None = None
    prompt_tokens: int | None = None

    def on_payload(self, payload: str, now: float) -> bool:
        """Handle one SSE payload; return True at `[DONE]`."""
        if payload.strip() == "[DONE]":
            return True
        data = json.loads(payload)
        if "error" in data:
            raise OnlineBenchError(f"server error in stream: {data['error']}")
        if data.get("choices") and _carries_output(data["choices"][0]):
            self.token_times.append(now)
        usage = data.get("usage")
        if usage:
            self.output_tokens = usage.get("completion_tokens", self.output_tokens)
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        return False


def _carries_output(choice: dict[str, Any]) -> bool:
    """A completions chunk always; a chat chunk when its delta holds output (not the first,
    role-only one)."""
    if "delta" not in choice:
        return True
    delta = choice["delta"] or {}
    return bool(delta.get("content") or delta.get("reasoning") or delta.get("tool_calls"))


def build_payload(model: str, request: BenchRequest, text: str | None = None
                  ) -> dict[str, Any]:
    """A streaming completion of the prompt's token ids, or (with `text`) a chat request."""
    body: dict[str, Any] = {
        "model": request.lora_name or model,  # a LoRA adapter is named as the model
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if text is None:
        body["prompt"] = request.prompt_token_ids
    else:
        body["messages"] = [{"role": "user", "content": text}]
    return body


async def send_request(
    client: httpx.AsyncClient, url: str, model: str, request: BenchRequest,
    text: str | None = None
) -> RequestRecord:
    """Send one streaming completion (chat with `text`) and time it; never raises for a failed
    request."""
    state = _StreamState(token_times=[])
    start = time.perf_counter()
    error = ""
    try:
        async with client.stream("POST", url, json=build_payload(model, request, text)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")[:300]
                raise OnlineBenchError(f"HTTP {resp.status_code}: {body}")
            parser = SseParser()
            async for chunk in resp.aiter_bytes():
                now = time.perf_counter()
                if any(state.on_payload(p, now) for p in parser.feed(chunk)):
                    break
    except (httpx.HTTPError, OnlineBenchError, json.JSONDecodeError) as e:
        error = f"{type(e).__name__}: {e}"
    return _to_record(request, state, start, error)


async def send_embedding(
    client: httpx.AsyncClient, url: str, model: str, request: BenchRequest,
    text: str | None = None
) -> RequestRecord:
    """Embed one prompt (token ids, base64 floats) and time it; never raises for a failed
    request. The response must hold one embedding; its usage gives the prompt's length."""
    body = {"model": request.lora_name or model, "input": request.prompt_token_ids,
            "encoding_format": "base64"}
    start = time.perf_counter()
    error, prompt_len = "", request.prompt_len
    try:
        resp = await client.post(url, json=body)
        if resp.status_code != 200:
            raise OnlineBenchError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        doc = resp.json()
        if len(doc.get("data") or []) != 1 or not doc["data"][0].get("embedding"):
            raise OnlineBenchError(f"expected one embedding, got {str(doc)[:200]}")
        prompt_len = int((doc.get("usage") or {}).get("prompt_tokens", prompt_len))
    except (httpx.HTTPError, OnlineBenchError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    return RequestRecord(prompt_len, 0, start, None if error else end, [], end, not error, error)


def _to_record(request: BenchRequest, state: _StreamState, start: float,
               error: str) -> RequestRecord:
    if not error and not state.token_times:
        error = "stream ended without a token chunk"
    times = state.token_times
    return RequestRecord(
        prompt_len=state.prompt_tokens or request.prompt_len,
        # Without usage, fall back to one token per chunk (an undercount if chunks batch tokens).
        output_len=state.output_tokens if state.output_tokens is not None else len(times),
        start_time=start,
        first_token_time=times[0] if times else None,
        token_times=times,
        end_time=times[-1] if times else time.perf_counter(),
        success=not error,
        error=error,
    )


def _failed(request: BenchRequest, error: str) -> RequestRecord:
    now = time.perf_counter()
    return RequestRecord(request.prompt_len, 0, now, None, [], now, False, error)


async def resolve_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id from GET /v1/models (used when --model is not given)."""
    try:
        resp = await client.get(f"{base_url}/v1/models")
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise OnlineBenchError(
            f"could not read a model id from {base_url}/v1/models ({e}); pass --model"
        ) from e


@dataclass(frozen=True, slots=True)
class OnlineSettings:
    """How requests are sent."""

    base_url: str
    model: str | None = None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    total_timeout_s: float = 3600.0
    allow_remote: bool = False
    endpoint: str = "completions"  # or "chat", "embeddings"
    api_key: str | None = None     # sent as `Authorization: Bearer KEY`


def _client(settings: OnlineSettings, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    # trust_env=False: a proxy from the environment must not reroute a loopback benchmark.
    return httpx.AsyncClient(timeout=settings.request_timeout_s, headers=headers,
                             limits=httpx.Limits(max_connections=connections), trust_env=False)


async def server_vocabulary(settings: OnlineSettings) -> tuple[str, list[int]]:
    """The served model's name (`settings.model`, else the server's first) and real token ids
    of its tokenizer to draw prompts from."""
    base_url = check_target(settings.base_url, settings.allow_remote)
    async with _client(settings, 1) as client:
        model = settings.model or await resolve_model(client, base_url)
        return model, await vocabulary_sample(client, base_url, model)


async def run_online(
    settings: OnlineSettings,
    requests: list[BenchRequest],
    arrival_offsets: list[float],
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float, str]:
    """Send `requests` at `arrival_offsets` (seconds from start); return records (in request
    order), the wall duration and the model name used."""
    base_url = check_target(settings.base_url, settings.allow_remote)
    if settings.endpoint not in ENDPOINTS:
        raise OnlineBenchError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got "
                               f"{settings.endpoint!r}")
    embeds = settings.endpoint == "embeddings"
    send = send_embedding if embeds else send_request
    if len(arrival_offsets) != len(requests):
        raise OnlineBenchError("arrival_offsets must have one entry per request")
    async with _client(settings, settings.max_concurrency or len(requests) or 1) as client:
        model = settings.model or await resolve_model(client, base_url)
        texts: list[str | None] = [None] * len(requests)
        if settings.endpoint == "chat":
            texts = list(await detokenize_all(client, base_url, model,
                                              [r.prompt_token_ids for r in requests]))
        url = base_url + {"embeddings": EMBEDDINGS_PATH, "chat": CHAT_PATH}.get(
            settings.endpoint, COMPLETIONS_PATH)
        sem = asyncio.Semaphore(settings.max_concurrency or len(requests) or 1)
        start = time.perf_counter()

        async def one(req: BenchRequest, offset: float, text: str | None) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with sem:
                record = await send(client, url, model, req, text)
            if on_done is not None:
                on_done(record)
            return record

        tasks = [asyncio.create_task(one(r, t, text))
                 for r, t, text in zip(requests, arrival_offsets, texts, strict=True)]
        _, pending = await asyncio.wait(tasks, timeout=settings.total_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    timeout_msg = f"cancelled at the total timeout ({settings.total_timeout_s:g} s)"
    records = [_task_record(t, r, timeout_msg) for t, r in zip(tasks, requests, strict=True)]
    return records, duration, model


def _task_record(task: asyncio.Task[RequestRecord], request: BenchRequest,
                 timeout_msg: str) -> RequestRecord:
    if task.cancelled():
        return _failed(request, timeout_msg)
    exc = task.exception()
    if exc is not None:
        return _failed(request, f"{type(exc).__name__}: {exc}")
    return task.result()
