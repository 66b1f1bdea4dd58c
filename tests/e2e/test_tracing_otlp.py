"""Tracing from the install, into a real OTLP receiver, and the gateway's /metrics in vLLM's
shape: a gateway process (`splitserve serve --role gateway`, as deployed) started with
`--otlp-traces-endpoint` exports its spans over OTLP/gRPC to the protocol's own TraceService
served by this test; the spans join the client's trace (REST `traceparent` header, gRPC
`traceparent` metadata), carry the GenAI semantic conventions, and probes and scrapes make none.
Fake decode workers (real gRPC servers) stand behind it."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from protos.splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.gateway_fakes import MODEL_NAME, Harness, Script, smollm2_tokenizer
from tests.support.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]
REST_TRACE, REST_PARENT = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
GRPC_TRACE, GRPC_PARENT = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7


def _traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


class Gateway:
    def __init__(self, rest: int, grpc_port: int) -> None:
        self.rest, self.grpc = rest, grpc_port
        self.url = f"http://127.0.0.1:{rest}"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def gateway(receiver: OtlpReceiver) -> Iterator[Gateway]:
    ids = smollm2_tokenizer().encode(" Paris is lovely", add_special_tokens=False)
    with Harness(Script(ids, endless=True, token_delay_s=0.02), colocated=True) as fakes:
        ports = []
        for _ in range(2):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100"}  # export spans within 0.1 s
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve", "serve", "--role", "gateway", "--colocated",
             "--decode", fakes.decode[0].address, "--port", str(ports[0]), "--grpc-port",
             str(ports[1]), "--otlp-traces-endpoint", receiver.endpoint],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        gw = Gateway(*ports)
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, proc.communicate()[0]
                try:
                    with urllib.request.urlopen(f"{gw.url}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "the gateway did not become healthy"
                time.sleep(0.2)
            yield gw
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _attrs(span: object) -> dict[str, object]:
    out: dict[str, object] = {}
    for a in span.attributes:  # type: ignore[attr-defined]
        which = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, which) if which else None
    return out


@pytest.mark.timeout(120)
def test_spans_reach_a_real_otlp_receiver_inside_the_clients_traces(
        gateway: Gateway, receiver: OtlpReceiver) -> None:
    for path in ("/health", "/metrics", "/ping"):  # probes and scrapes: no traces
        assert httpx.get(gateway.url + path, timeout=10).status_code == 200
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=5, temperature=0.5, top_p=0.9, seed=7, stream=True,
        messages=[{"role": "user", "content": "Hi"}],
        extra_headers={"traceparent": _traceparent(REST_TRACE, REST_PARENT)})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc}") as ch:
        out = list(gateway_pb2_grpc.GatewayStub(ch).Generate(
            gateway_pb2.GenerateRequest(text="Hi", sampling=common_pb2.SamplingParams(
                max_tokens=3)), metadata=[("traceparent", _traceparent(GRPC_TRACE, GRPC_PARENT))],
            timeout=20))
    assert out[-1].WhichOneof("response") == "complete"

    (chat_service, chat), = receiver.wait_for(f"chat {MODEL_NAME}")
    (_, completion), = receiver.wait_for(f"text_completion {MODEL_NAME}")
    assert chat_service == "splitserve-gateway"
    # Both joined their client's trace, under the client's span (REST: FastAPI's server span
    # of the route may sit between them).
    with receiver.lock:
        by_id = {s.span_id: s for _, s in receiver.spans}
    parent = chat.parent_span_id
    while parent in by_id:
        parent = by_id[parent].parent_span_id
    assert (int.from_bytes(chat.trace_id, "big"), int.from_bytes(parent, "big")) == (
        REST_TRACE, REST_PARENT)
    assert (int.from_bytes(completion.trace_id, "big"),
            int.from_bytes(completion.parent_span_id, "big")) == (GRPC_TRACE, GRPC_PARENT)
    a = _attrs(chat)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "splitserve"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == MODEL_NAME
    assert a["gen_ai.response.id"] == a["splitserve.request_id"]
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.seed"] == 7
    assert a["gen_ai.usage.output_tokens"] == 5
    assert isinstance(a["gen_ai.response.time_to_first_chunk"], float)
    assert "splitserve.cancelled" not in a, "a stream read to its end is not cancelled"
    assert _attrs(completion)["gen_ai.operation.name"] == "text_completion"
    # Every span received belongs to one of the two requests' traces.
    time.sleep(0.5)  # anything else exported would have arrived by now
    with receiver.lock:
        traces = {int.from_bytes(s.trace_id, "big") for _, s in receiver.spans}
        names = sorted(s.name for _, s in receiver.spans)
    assert traces == {REST_TRACE, GRPC_TRACE}, names


def _sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return None


@pytest.mark.timeout(120)
def test_metrics_are_labelled_and_shaped_like_vllms(gateway: Gateway,
                                                    receiver: OtlpReceiver) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    before = httpx.get(gateway.url + "/metrics", timeout=10).text
    aborted = _sample(before, "splitserve:request_success_total", finished_reason="abort") or 0
    stream = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=200,
                                       stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()  # the client goes away mid-stream
    client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4)
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(gateway.url + "/metrics", timeout=10).text
        now = _sample(text, "splitserve:request_success_total", finished_reason="abort") or 0
        if now == aborted + 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert now == aborted + 1, "the aborted stream is counted"
    # Its span: cancelled, with the tokens it had sent (not 0).
    deadline = time.monotonic() + 20
    while not (cancelled := [a for _, span in list(receiver.spans)
                             if span.name == f"text_completion {MODEL_NAME}"
                             and (a := _attrs(span)).get("splitserve.cancelled")]):
        assert time.monotonic() < deadline, "no cancelled span arrived"
        time.sleep(0.1)
    assert int(cancelled[0]["gen_ai.usage.output_tokens"]) >= 3  # type: ignore[call-overload]
    # Every series carries the served model's name.
    series = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert series and all(f'model_name="{MODEL_NAME}"' in ln for ln in series), [
        ln for ln in series if "model_name" not in ln][:3]
    for name in ("queue", "prefill", "decode", "inference"):
        assert (_sample(text, f"splitserve:request_{name}_time_seconds_count") or 0) >= 1, name
    for name in ("request_prompt_tokens_count", "request_generation_tokens_count",
                 "request_time_per_output_token_seconds_count", "iteration_tokens_total_count"):
        assert (_sample(text, f"splitserve:{name}") or 0) >= 1, name
    assert _sample(text, "splitserve:cache_config_info", role="decode") == 1.0
    assert (_sample(text, "process_resident_memory_bytes") or 0) > 0
