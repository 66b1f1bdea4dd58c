"""A cross-encoder through the whole stack: real SmolLM2 workers started as vLLM serves
Qwen3-Reranker (`classifier_from_token` no, yes), a real gateway, a real HTTP client.

`/v1/score` and `/v1/rerank` read each pair as one input and score it with the sigmoid of
logit(yes) - logit(no): each score equals the in-process engine's own (`LLM.score` with the same
setting, itself checked against the LM head in tests/unit/engine/test_classifier.py). `/v1/classify` gives
the same probability per input; `/v1/embeddings` is refused on a classifier, and a bi-encoder
model's `/v1/classify` is refused. Disaggregated (pooling runs on the prefill pool), no KV
block left behind.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

import grpc  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine_api.pooling_params import PoolerConfig  # noqa: E402
from protos.splitserve.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from tests.support.e2e_stack import MODEL_NAME, LoopThread, Stack, start_stack  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

TOKENS = ("no", "yes")
QUERY = "Is this about the capital of France? Answer yes or no."
DOCS = ["The capital of France is Paris.", "Honey bees make honey.",
        "Paris is a city in France, on the Seine."]
TOL = 2e-4


@pytest.fixture(scope="module")
def cross_stack(loop_thread: LoopThread) -> Iterator[Stack]:
    stack = start_stack(loop_thread, colocated=False,
                        pooler=PoolerConfig(classifier_from_token=TOKENS))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def reference(smollm2_yes_no: LLM) -> list[float]:
    """QUERY against each of DOCS, scored by the in-process engine (classifier_from_token=TOKENS)."""
    assert TOKENS == ("no", "yes")  # the session engine's labels
    return [o.outputs.score for o in smollm2_yes_no.score(QUERY, DOCS)]


def _post(stack: Stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack.rest_url.removesuffix("/v1") + path, json=body, timeout=120)


def test_score_and_rerank_cross_encode(cross_stack: Stack, reference: list[float]) -> None:
    assert len({round(s, 3) for s in reference}) == len(DOCS)  # distinct: the order means something
    r = _post(cross_stack, "/v1/score", {"model": MODEL_NAME, "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["score"] for d in body["data"]] == pytest.approx(reference, abs=TOL)
    pairs = [cross_stack.tokenizer.encode_pair(QUERY, d) for d in DOCS]
    assert body["usage"]["prompt_tokens"] == sum(map(len, pairs))

    # Pairwise with a repeated pair: it runs once.
    r = _post(cross_stack, "/score", {"text_1": [QUERY, QUERY], "text_2": [DOCS[1], DOCS[1]]})
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx([reference[1]] * 2, abs=TOL)
    assert r.json()["usage"]["prompt_tokens"] == len(pairs[1])

    r = _post(cross_stack, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})
    assert r.status_code == 200, r.text
    want = sorted(range(len(DOCS)), key=lambda i: -reference[i])[:2]
    results = r.json()["results"]
    assert [x["index"] for x in results] == want
    assert [x["relevance_score"] for x in results] == pytest.approx(
        [reference[i] for i in want], abs=TOL)
    cross_stack.wait_idle()


def test_classify_and_refusals(cross_stack: Stack, disagg_stack: Stack,
                               reference: list[float]) -> None:
    text = cross_stack.tokenizer.decode(cross_stack.tokenizer.encode_pair(QUERY, DOCS[0]),
                                        skip_special_tokens=False)
    r = _post(cross_stack, "/v1/classify", {"model": MODEL_NAME, "input": [text, DOCS[1]]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    first, second = body["data"]
    assert (first["index"], first["num_classes"], first["label"]) == (0, 1, "yes")
    assert first["probs"] == pytest.approx([reference[0]], abs=TOL)
    assert second["index"] == 1 and 0.0 < second["probs"][0] < 1.0
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] > 0

    r = _post(cross_stack, "/v1/embeddings", {"input": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    r = _post(cross_stack, "/v1/score", {"text_1": QUERY, "text_2": [[1, 2, 3]]})
    assert r.status_code == 400 and "both be texts" in r.json()["error"]["message"], r.text
    r = _post(disagg_stack, "/classify", {"input": "hello"})   # an embedding model
    assert r.status_code == 400 and "not a classifier" in r.json()["error"]["message"], r.text
    cross_stack.wait_idle()
    disagg_stack.wait_idle()


def test_the_grpc_api(cross_stack: Stack, disagg_stack: Stack, reference: list[float]) -> None:
    """Gateway.Score and Gateway.Classify: the same numbers as REST's."""
    def text(t: str) -> gateway_pb2.EmbeddingInput:
        return gateway_pb2.EmbeddingInput(text=t)

    with grpc.insecure_channel(cross_stack.grpc_target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        scored = stub.Score(gateway_pb2.ScoreRequest(
            model=MODEL_NAME, text_1=[text(QUERY)], text_2=[text(d) for d in DOCS]), timeout=120)
        assert list(scored.scores) == pytest.approx(reference, abs=TOL)
        pairs = [cross_stack.tokenizer.encode_pair(QUERY, d) for d in DOCS]
        assert scored.prompt_tokens == sum(map(len, pairs))
        pair = cross_stack.tokenizer.decode(pairs[2], skip_special_tokens=False)
        classified = stub.Classify(gateway_pb2.ClassifyRequest(inputs=[text(pair)]), timeout=120)
        [c] = classified.data
        assert c.label == "yes" and list(c.probs) == pytest.approx([reference[2]], abs=TOL)
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(gateway_pb2.ScoreRequest(text_1=[text(QUERY)]), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "text_2" in (err.value.details() or "")
    with grpc.insecure_channel(disagg_stack.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            gateway_pb2_grpc.GatewayStub(channel).Classify(
                gateway_pb2.ClassifyRequest(inputs=[text("hello")]), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a classifier" in (err.value.details() or "")
    cross_stack.wait_idle()
