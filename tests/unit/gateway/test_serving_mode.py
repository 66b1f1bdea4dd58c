"""Degraded serving modes through a real gateway and fake workers (real gRPC servers):
a pool left without a healthy worker never takes the service down while the other pool lives
(gateway/serving_mode.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc
import httpx
import pytest
from openai import OpenAI

from tests.support.gateway_fakes import MODEL_NAME, Harness, Script, smollm2_tokenizer
from tests.support.prom import sample_value


@pytest.fixture(scope="module")
def script_ids() -> list[int]:
    return list(smollm2_tokenizer().encode(
        " Paris is the capital of France. It is known for the Eiffel Tower."))


def _text(ids: list[int]) -> str:
    return smollm2_tokenizer().decode(ids, skip_special_tokens=True)


def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s}s"
        time.sleep(0.05)


def _mode(h: Harness) -> str:
    return str(httpx.get(h.base_url + "/health", timeout=10).json()["serving_mode"])


def _gauge(h: Harness, mode: str) -> float:
    """`splitserve:serving_mode{mode=...}` from the gateway's /metrics."""
    return sample_value(httpx.get(h.base_url + "/metrics", timeout=10).text,
                        "splitserve:serving_mode", mode=mode)


def _complete(h: Harness, max_tokens: int, stream: bool = False) -> str:
    client = OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0)
    if stream:
        chunks = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=max_tokens,
                                           temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks)
    out = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=max_tokens,
                                    temperature=0)
    return out.choices[0].text


def test_no_prefill_worker_serves_whole_requests_on_decode_and_comes_back(
        script_ids: list[int], caplog: pytest.LogCaptureFixture) -> None:
    """decode_only while the prefill pool is down (logged, gauged, in /health), then
    disaggregated again once its worker is back on the same address."""
    caplog.set_level(logging.INFO, logger="gateway.serving_mode")
    with Harness(Script(list(script_ids))) as h:
        assert _mode(h) == "disaggregated" and _gauge(h, "disaggregated") == 1.0
        prefill = h.prefill[0]
        port = int(prefill.address.rsplit(":", 1)[1])
        h.run(prefill.stop())
        _until(lambda: _mode(h) == "decode_only", "decode_only")
        assert httpx.get(h.base_url + "/health", timeout=10).status_code == 200
        assert _complete(h, 6) == _text(script_ids[:6])
        assert not prefill.prefill_requests
        whole = h.decode[0].decode_requests[-1]
        assert not whole.HasField("kv_handle") and not whole.output_token_ids
        assert _gauge(h, "decode_only") == 1.0 and _gauge(h, "disaggregated") == 0.0
        h.run(prefill.start(port))
        _until(lambda: _mode(h) == "disaggregated", "disaggregated again")
        assert _complete(h, 6) == _text(script_ids[:6])
        assert len(prefill.prefill_requests) == 1
    changes = [r.getMessage() for r in caplog.records if "serving mode" in r.getMessage()]
    assert changes == ["serving mode disaggregated (healthy workers: prefill 1/1, decode 1/1)",
                       "serving mode disaggregated -> decode_only (healthy workers: prefill "
                       "0/1, decode 1/1)", "serving mode decode_only -> disaggregated (healthy "
                       "workers: prefill 1/1, decode 1/1)"]


def test_no_decode_worker_serves_whole_requests_on_prefill(script_ids: list[int]) -> None:
    """prefill_only: the prefill worker's Decode runs the request (under an id of its own: the
    Prefill id may still name a lease there); no Prefill call is made."""
    with Harness(Script(list(script_ids)), dead_decode=True) as h:
        _until(lambda: _mode(h) == "prefill_only", "prefill_only")
        assert _complete(h, 5, stream=True) == _text(script_ids[:5])
        worker = h.prefill[0]
        assert not worker.prefill_requests
        [whole] = worker.decode_requests
        assert whole.request_id.endswith("-0-whole") and not whole.HasField("kv_handle")


def test_stream_cut_by_the_last_decode_worker_resumes_on_prefill(script_ids: list[int]) -> None:
    """The only decode worker dies after 3 tokens: the stream resumes on the prefill worker
    from the last token sent (no token lost or doubled), and the lease is released."""
    with Harness(Script(list(script_ids), die_after=3)) as h:
        assert _complete(h, 12, stream=True) == _text(script_ids[:12])
        [resumed] = h.prefill[0].decode_requests
        assert list(resumed.output_token_ids) == script_ids[:4]  # first + 3 decoded
        assert not resumed.HasField("kv_handle")
        rid = h.prefill[0].prefill_requests[-1].request_id
        _until(lambda: h.prefill[0].released == [rid], "the lease's release")


def test_prefill_pool_down_mid_request_computes_it_on_decode(script_ids: list[int]) -> None:
    """A Prefill answered UNAVAILABLE (its worker died under it): the request goes whole to a
    decode worker instead of failing, as nothing reached the client yet."""
    with Harness(Script(list(script_ids), prefill_error=grpc.StatusCode.UNAVAILABLE)) as h:
        assert _complete(h, 4) == _text(script_ids[:4])
        [prefill] = h.prefill[0].prefill_requests
        whole = h.decode[0].decode_requests[-1]
        assert not whole.HasField("kv_handle") and not whole.output_token_ids
        # Its answer lost, the worker may still hold a lease for it: released, not left to
        # expire.
        _until(lambda: h.prefill[0].released == [prefill.request_id], "the lease's release")


def test_full_workers_are_a_429_not_a_mode_change(script_ids: list[int]) -> None:
    """A decode worker refusing for load (RESOURCE_EXHAUSTED) is a 429 with Retry-After; the
    request is not moved to the prefill pool."""
    with Harness(Script(list(script_ids), decode_error=grpc.StatusCode.RESOURCE_EXHAUSTED)) as h:
        r = httpx.post(h.base_url + "/v1/completions", timeout=10,
                       json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 4})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert not h.prefill[0].decode_requests
        assert _mode(h) == "disaggregated"


def test_a_stream_on_a_stopped_worker_resumes_elsewhere_in_bounded_time(
        script_ids: list[int]) -> None:
    """The only decode worker freezes after 3 tokens (as under SIGSTOP: connections open,
    nothing answers): the stream is abandoned within stall + liveness time and resumes on the
    prefill worker from the last token sent, none lost or doubled."""
    with Harness(Script(list(script_ids), freeze_after=3), stream_stall_s=0.3,
                 liveness_timeout_s=0.3) as h:
        start = time.monotonic()
        assert _complete(h, 12, stream=True) == _text(script_ids[:12])
        assert time.monotonic() - start < 5.0
        [resumed] = h.prefill[0].decode_requests
        assert list(resumed.output_token_ids) == script_ids[:4]  # first + 3 decoded
        metrics = httpx.get(h.base_url + "/metrics", timeout=10).text
        assert sample_value(metrics, "splitserve:decode_stalls_total") == 1.0
        h.decode[0].frozen = False  # thawed: it finds its stream cancelled
        _until(h.decode[0].cancelled.is_set, "the abandoned stream's cancellation")


def test_a_slow_live_worker_keeps_its_stream(script_ids: list[int]) -> None:
    """Tokens slower than the stall time from a worker whose health check answers: a busy
    worker, not a stopped one; the stream stays there."""
    with Harness(Script(list(script_ids), token_delay_s=0.4), stream_stall_s=0.1,
                 liveness_timeout_s=1.0) as h:
        assert _complete(h, 5, stream=True) == _text(script_ids[:5])
        assert not h.prefill[0].decode_requests and len(h.decode[0].decode_requests) == 1


def test_a_prefill_on_a_stopped_worker_goes_whole_to_decode(script_ids: list[int]) -> None:
    """The prefill worker freezes during the Prefill (as under SIGSTOP): abandoned within
    stall + liveness time, the request is computed whole on the decode worker (nothing had
    reached the client), and the lease it may hold is released."""
    with Harness(Script(list(script_ids), prefill_freeze=True), stream_stall_s=0.3,
                 liveness_timeout_s=0.3) as h:
        start = time.monotonic()
        assert _complete(h, 6) == _text(script_ids[:6])
        assert time.monotonic() - start < 5.0
        whole = h.decode[0].decode_requests[-1]
        assert not whole.HasField("kv_handle") and not whole.output_token_ids
        [prefill] = h.prefill[0].prefill_requests
        _until(lambda: h.prefill[0].released == [prefill.request_id], "the lease's release")
        h.prefill[0].frozen = False
