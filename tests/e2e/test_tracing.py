"""OpenTelemetry traces across gateway → prefill → decode (→ KV pull), on the real stack.

The SDK's in-memory exporter is installed as the process's tracer provider (OpenTelemetry
allows one per process: installed once, or added to an SDK provider already installed); spans
of every in-process service of `disagg_stack` land in it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from rpc import tracing
from tests.support.e2e_stack import MODEL_NAME, RPC_TIMEOUT_S, Stack

pytest_plugins = ["tests.support.e2e_stack"]

SPAN_WAIT_S = 30.0
MAX_TOKENS = 4
# Unique text, long enough (> 2 blocks of 16 tokens) that decode pulls KV from prefill.
PROMPT = ("Tracing test: the lighthouse keeper counted seventeen gulls, four herons, a lonely "
          "cormorant and two sleepy seals on the northern rocks before the evening fog rolled "
          "in across the bay and covered the harbour lights")
ROOT_SPAN = f"text_completion {MODEL_NAME}"  # GenAI's "{operation} {model}"
EXPECTED = {ROOT_SPAN, "prefill", "decode", "splitserve.prefill", "splitserve.decode",
            "splitserve.kv_pull", "splitserve.kv_serve"}


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    mem = InMemorySpanExporter()
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):  # installed earlier in this process
        current.add_span_processor(SimpleSpanProcessor(mem))
    else:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(mem))
        assert tracing.setup_tracing("splitserve-test", provider=provider)
        assert trace.get_tracer_provider() is provider
    yield mem
    mem.clear()


def _wait_for_trace(mem: InMemorySpanExporter, trace_id: int | None = None) -> list[ReadableSpan]:
    """The finished spans of the one request's trace, once all EXPECTED names are in (server
    spans end a moment after the gateway has its answer); bounded by SPAN_WAIT_S."""
    deadline = time.monotonic() + SPAN_WAIT_S
    while True:
        spans = list(mem.get_finished_spans())
        roots = [s for s in spans if s.name == ROOT_SPAN]
        if roots:
            assert len(roots) == 1, [s.name for s in spans]
            assert roots[0].context is not None
            tid = roots[0].context.trace_id
            mine = [s for s in spans if s.context is not None and s.context.trace_id == tid]
            if {s.name for s in mine} >= EXPECTED or time.monotonic() > deadline:
                return mine
        elif time.monotonic() > deadline:
            return spans
        time.sleep(0.05)


def _one(spans: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{name}: {len(found)} spans among {[s.name for s in spans]}"
    return found[0]


def _is_child(child: ReadableSpan, parent: ReadableSpan) -> bool:
    assert parent.context is not None
    return child.parent is not None and child.parent.span_id == parent.context.span_id


def test_one_request_is_one_trace_across_services(disagg_stack: Stack,
                                                   exporter: InMemorySpanExporter) -> None:
    disagg_stack.wait_idle()
    exporter.clear()
    resp = httpx.post(f"{disagg_stack.rest_url}/completions", timeout=RPC_TIMEOUT_S, json={
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    spans = _wait_for_trace(exporter)
    names = {s.name for s in spans}
    assert names >= EXPECTED, f"missing spans: {EXPECTED - names}"

    root = _one(spans, ROOT_SPAN)
    prefill, decode = _one(spans, "prefill"), _one(spans, "decode")
    srv_prefill, srv_decode = _one(spans, "splitserve.prefill"), _one(spans, "splitserve.decode")
    kv_pull = _one(spans, "splitserve.kv_pull")
    kv_serve = _one(spans, "splitserve.kv_serve")

    # One trace; the links: root → {prefill → splitserve.prefill, decode → splitserve.decode
    # → splitserve.kv_pull → splitserve.kv_serve (on the prefill worker)}.
    assert len({s.context.trace_id for s in spans if s.context is not None}) == 1
    # FastAPI's own server spans (if the installed FastAPI emits them) may sit above ours.
    assert root.parent is None or not root.parent.is_remote
    assert _is_child(prefill, root) and _is_child(decode, root)
    assert _is_child(srv_prefill, prefill) and srv_prefill.parent is not None
    assert srv_prefill.parent.is_remote, "the prefill server span's parent came over gRPC"
    assert _is_child(srv_decode, decode) and srv_decode.parent is not None
    assert srv_decode.parent.is_remote
    assert _is_child(kv_pull, srv_decode)
    assert _is_child(kv_serve, kv_pull) and kv_serve.parent is not None
    assert kv_serve.parent.is_remote, "the KV pull's trace context came over gRPC"
    assert kv_serve.kind == SpanKind.SERVER
    assert srv_prefill.kind == SpanKind.SERVER and srv_decode.kind == SpanKind.SERVER

    # GenAI semantic-convention attributes on the request span.
    a = root.attributes or {}
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == MODEL_NAME
    assert a["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == MAX_TOKENS
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)  # type: ignore[arg-type]

    # Worker-side attributes, and nothing failed.
    pa, da, ka = srv_prefill.attributes or {}, srv_decode.attributes or {}, kv_pull.attributes or {}
    assert pa["splitserve.prompt_tokens"] == usage["prompt_tokens"]
    assert pa["splitserve.kv_handle"] is True
    assert "splitserve.cached_tokens" in pa
    assert da["splitserve.prompt_tokens"] == usage["prompt_tokens"]
    assert da["splitserve.kv_recomputed"] is False
    assert da["splitserve.output_tokens"] == MAX_TOKENS
    # The gateway's speculative policy on its decode span (a worker that reports no measured
    # step cost gets the load threshold: 4 drafts below 4 pending requests), and what the worker
    # was asked for on its own. The load is the router's last poll (every 0.5 s), which may
    # still count an earlier test's requests.
    ga = decode.attributes or {}
    load = ga["splitserve.decode_worker_load"]
    assert isinstance(load, int) and load >= 0
    assert ga["splitserve.speculative_reason"] == "threshold"
    assert ga["splitserve.speculative_class"] in ("code", "repetitive", "text")
    assert ga["splitserve.num_speculative_tokens"] == da["splitserve.num_speculative_tokens"] == (
        4 if load < 4 else 0)
    assert ka["splitserve.kv.ok"] is True
    sa = kv_serve.attributes or {}
    assert sa["splitserve.kv.bytes"] > 0  # type: ignore[operator]
    # Loopback workers hand KV over the data port (one call, then raw bytes); the stream
    # would count its fragments.
    assert sa.get("splitserve.kv.transport") == "tcp"
    assert ka["splitserve.kv.source"] == f"127.0.0.1:{disagg_stack.workers['prefill'].port}"
    for s in spans:
        assert s.status.status_code != StatusCode.ERROR, (s.name, s.status.description)
    disagg_stack.wait_idle()


def test_failed_span_records_error(exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    with pytest.raises(RuntimeError), tracing.traced_span("boom", parent=None):
        raise RuntimeError("kaput")
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert span.status.description == "RuntimeError: kaput"


def test_traceparent_round_trips_through_metadata(exporter: InMemorySpanExporter) -> None:
    with tracing.traced_span("parent", parent=None) as span:
        metadata = tracing.inject_metadata(tracing.span_context(span))
        assert [k for k, _ in metadata if k == "traceparent"] == ["traceparent"]
        remote = trace.get_current_span(tracing.extract_context(metadata)).get_span_context()
        assert remote.trace_id == span.get_span_context().trace_id
        assert remote.span_id == span.get_span_context().span_id and remote.is_remote


def test_no_exporter_without_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracing.ENDPOINT_ENV, raising=False)
    assert tracing.setup_tracing("splitserve-test") is False
    # Without a span in the context nothing is injected: no-op tracing sends no metadata.
    assert tracing.inject_metadata(tracing.extract_context(None)) == ()
