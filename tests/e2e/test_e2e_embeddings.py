"""Embeddings through the whole stack (real SmolLM2 workers, real gateway): the unmodified
`openai` client's `embeddings.create` (floats, base64 as the client asks for it by default and
as a string), token-id inputs, `dimensions`, the gateway's gRPC `Embed`, and the errors — each
vector equal to the engine's own `LLM.embed` of the same model, disaggregated (the prefill
worker embeds) and colocated (the only worker does), no KV block left behind."""

from __future__ import annotations

import asyncio
import base64
import struct

import grpc
import httpx
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

import torch  # noqa: E402
from openai import BadRequestError, NotFoundError, OpenAI  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine_api.pooling_params import PoolingParams  # noqa: E402
from engine_api.tokenizer import Tokenizer  # noqa: E402
from protos.splitserve.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from tests.support.e2e_stack import MAX_MODEL_LEN, MODEL_NAME, Stack  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is Paris.", "Honey bees make honey.",
         "A lighthouse keeper watches the sea at night, year after year, in every weather."]
TOL = dict(atol=2e-5, rtol=1e-4)


def _client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.rest_url, api_key="x", max_retries=0, timeout=120)


def _stack(which: str, disagg_stack: Stack, colocated_stack: Stack) -> Stack:
    return disagg_stack if which == "disagg" else colocated_stack


@pytest.fixture(scope="module")
def reference(smollm2: LLM) -> list[torch.Tensor]:
    """TEXTS' embeddings by the in-process engine (the model's default: LAST, normalized)."""
    return [torch.tensor(o.outputs.embedding) for o in smollm2.embed(TEXTS)]


@pytest.mark.parametrize("which", ["disagg", "colocated"])
def test_openai_client_embeddings_equal_llm_embed(which: str, disagg_stack: Stack,
                                                  colocated_stack: Stack, tokenizer: Tokenizer,
                                                  reference: list[torch.Tensor]) -> None:
    stack = _stack(which, disagg_stack, colocated_stack)
    client = _client(stack)
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    # No encoding_format: the client asks for base64 and decodes it itself.
    decoded = client.embeddings.create(model=MODEL_NAME, input=TEXTS)
    for resp in (floats, decoded):
        assert resp.object == "list" and resp.model == MODEL_NAME
        assert [d.index for d in resp.data] == [0, 1, 2]
        assert all(d.object == "embedding" for d in resp.data)
        n = sum(len(tokenizer.encode(t)) for t in TEXTS)
        assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (n, n)
        for d, want in zip(resp.data, reference, strict=True):
            assert len(d.embedding) == 576  # SmolLM2-135M's hidden size
            torch.testing.assert_close(torch.tensor(d.embedding), want, **TOL)
    # Asked for explicitly, base64 comes back as OpenAI sends it: little-endian float32 bytes.
    raw = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], encoding_format="base64")
    packed = base64.b64decode(str(raw.data[0].embedding))
    assert len(packed) == 576 * 4
    torch.testing.assert_close(torch.tensor(struct.unpack("<576f", packed)), reference[0], **TOL)
    stack.wait_idle()  # every prompt's blocks freed (or cached), no lease, no request


def test_token_ids_dimensions_and_the_grpc_api(disagg_stack: Stack, tokenizer: Tokenizer,
                                               smollm2: LLM) -> None:
    client = _client(disagg_stack)
    ids = [tokenizer.encode(t) for t in TEXTS[:2]]
    want = [torch.tensor(o.outputs.embedding) for o in smollm2.embed(
        [{"prompt_token_ids": p} for p in ids], PoolingParams(dimensions=32))]
    one = client.embeddings.create(model=MODEL_NAME, input=ids[0], dimensions=32)
    many = client.embeddings.create(model=MODEL_NAME, input=ids, dimensions=32)
    assert one.usage.prompt_tokens == len(ids[0])
    assert many.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    got = [torch.tensor(d.embedding) for d in [*one.data, *many.data]]
    for g, w in zip(got, [want[0], *want], strict=True):
        assert g.shape == (32,)
        assert g.norm().item() == pytest.approx(1.0, abs=1e-5)  # renormalized after the cut
        torch.testing.assert_close(g, w, **TOL)
    with grpc.insecure_channel(disagg_stack.grpc_target) as channel:
        resp = gateway_pb2_grpc.GatewayStub(channel).Embed(gateway_pb2.EmbeddingsRequest(
            inputs=[gateway_pb2.EmbeddingInput(text=TEXTS[0]),
                    gateway_pb2.EmbeddingInput(token_ids=gateway_pb2.TokenIds(ids=ids[1]))],
            dimensions=32), timeout=120)
    assert resp.prompt_tokens == len(ids[0]) + len(ids[1])
    for e, w in zip(resp.data, want, strict=True):
        torch.testing.assert_close(torch.tensor(struct.unpack("<32f", e.embedding)), w, **TOL)
    metrics = httpx.get(f"http://127.0.0.1:{disagg_stack.gateway.rest_port}/metrics").text
    assert 'splitserve:requests_received_total{api="embeddings",' in metrics
    disagg_stack.wait_idle()


@pytest.mark.parametrize(("body", "words"), [
    ({"input": ""}, ["input must not be empty"]),
    ({"input": []}, ["input must not be empty"]),
    ({"input": [[1, 2], "text"]}, ["input must be"]),
    ({"input": ["a"] * 2049}, ["at most 2048"]),
    ({"input": [[5] * (MAX_MODEL_LEN + 1)]}, ["input has 2049 tokens", "at most 2048"]),
    ({"input": [[5], [49152]]}, ["input.1[0] = 49152", "[0, 49152)"]),
    ({"input": "x", "dimensions": 0}, ["dimensions must be an integer >= 1"]),
    ({"input": "x", "dimensions": 577}, ["dimensions must be at most 576"]),
    ({"input": "x", "encoding_format": "int8"}, ["encoding_format"]),
])
def test_bad_requests_are_400_in_openai_error_shape(disagg_stack: Stack, body: dict[str, object],
                                                    words: list[str]) -> None:
    r = httpx.post(f"{disagg_stack.rest_url}/embeddings", json={"model": MODEL_NAME, **body},
                   timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert all(w in error["message"] for w in words), error["message"]


def test_errors_through_the_clients(disagg_stack: Stack) -> None:
    client = _client(disagg_stack)
    with pytest.raises(NotFoundError, match="does not exist"):
        client.embeddings.create(model="no-such-model", input="x")
    with pytest.raises(BadRequestError, match="allows at most 2048 tokens per prompt"):
        client.embeddings.create(model=MODEL_NAME, input=[7] * (MAX_MODEL_LEN + 1))
    with grpc.insecure_channel(disagg_stack.grpc_target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for request, message in [
                (gateway_pb2.EmbeddingsRequest(), "inputs must not be empty"),
                (gateway_pb2.EmbeddingsRequest(inputs=[gateway_pb2.EmbeddingInput()]),
                 "inputs.0: set text or token_ids"),
                (gateway_pb2.EmbeddingsRequest(inputs=[gateway_pb2.EmbeddingInput(text="x")],
                                               pooling_type=9), "pooling_type 9")]:
            with pytest.raises(grpc.RpcError) as info:
                stub.Embed(request, timeout=120)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in (info.value.details() or "")
    disagg_stack.wait_idle()


def test_a_client_gone_mid_batch_cancels_its_embeddings(disagg_stack: Stack,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client leaves while a long batch is computed: the gateway cancels its calls and the
    prefill worker aborts what is left (observed by a spy on its engine's abort), its blocks
    freed."""
    engine = disagg_stack.workers["prefill"].aengine.engine  # type: ignore[union-attr]
    aborted: list[str] = []
    abort = engine.abort_request

    def spy(request_id: str) -> bool:
        aborted.append(request_id)
        return abort(request_id)

    monkeypatch.setattr(engine, "abort_request", spy)
    text = " ".join(f"Fact {i} about the ocean." for i in range(60))  # ~400 tokens
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{disagg_stack.rest_url}/embeddings",
                   json={"model": MODEL_NAME, "input": [f"{i}: {text}" for i in range(24)]},
                   timeout=0.5)
    disagg_stack.wait_idle()
    assert any(rid.startswith("embd-") for rid in aborted), aborted


def test_online_benchmark_embeds_through_the_gateway(disagg_stack: Stack) -> None:
    """`splitserve bench online --endpoint embeddings` against the real stack: every request
    embedded, its prompt tokens counted from the responses' usage, no tokens generated."""
    from bench.metrics import compute_metrics
    from bench.online import OnlineSettings, run_online
    from bench.workloads import random_requests

    requests = random_requests(6, 12, 1, 1000, seed=5)
    records, duration, model = asyncio.run(run_online(
        OnlineSettings(disagg_stack.rest_url.removesuffix("/v1"), endpoint="embeddings",
                       max_concurrency=3, total_timeout_s=60), requests, [0.0] * 6))
    assert model == MODEL_NAME
    assert all(r.success for r in records), [r.error for r in records]
    m = compute_metrics(records, duration)
    assert (m.completed, m.total_input_tokens, m.total_output_tokens) == (6, 72, 0)
    assert m.ttft.median_ms == pytest.approx(m.e2el.median_ms)
    disagg_stack.wait_idle()
