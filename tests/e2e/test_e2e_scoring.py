"""vLLM's score and rerank APIs through the whole stack (real SmolLM2 workers, real gateway, a
real HTTP client): each score equals the cosine similarity of the in-process engine's own
embeddings of the two texts (`LLM.embed`), rerank orders documents by it, and the errors are
400s naming the field — disaggregated and colocated, no KV block left behind."""

from __future__ import annotations

import httpx
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

import torch  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine_api.tokenizer import Tokenizer  # noqa: E402
from tests.support.e2e_stack import MODEL_NAME, Stack  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

QUERY = "What is the capital of France?"
DOCS = ["The capital of France is Paris.", "Honey bees make honey.",
        "Paris is a city in France, on the Seine.", "A lighthouse keeper watches the sea."]
TOL = 2e-4


@pytest.fixture(scope="module")
def cosines(smollm2: LLM) -> list[float]:
    """QUERY against each of DOCS: the dot products of the engine's unit embeddings."""
    vecs = [torch.tensor(o.outputs.embedding, dtype=torch.float64)
            for o in smollm2.embed([QUERY, *DOCS])]
    assert all(abs(float(v.norm()) - 1) < 1e-5 for v in vecs)
    return [float(vecs[0] @ v) for v in vecs[1:]]


def _post(stack: Stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack.rest_url.removesuffix("/v1") + path, json=body, timeout=120)


@pytest.mark.parametrize("which", ["disagg", "colocated"])
def test_score_one_to_many_and_pairwise(which: str, disagg_stack: Stack, colocated_stack: Stack,
                                        tokenizer: Tokenizer, cosines: list[float]) -> None:
    stack = disagg_stack if which == "disagg" else colocated_stack
    r = _post(stack, "/v1/score", {"model": MODEL_NAME, "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL_NAME
    assert body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert all(d["object"] == "score" for d in body["data"])
    got = [d["score"] for d in body["data"]]
    assert got == pytest.approx(cosines, abs=TOL)
    n = sum(len(tokenizer.encode(t)) for t in [QUERY, *DOCS])
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}

    # Pairwise (as many text_1 as text_2), token ids for one side, and the same query twice:
    # it is embedded once, so counted once.
    ids = [tokenizer.encode(d) for d in DOCS[:2]]
    r = _post(stack, "/score", {"model": MODEL_NAME, "text_1": [QUERY, QUERY], "text_2": ids})
    assert r.status_code == 200, r.text
    pair = r.json()
    assert [d["score"] for d in pair["data"]] == pytest.approx(cosines[:2], abs=TOL)
    assert pair["usage"]["prompt_tokens"] == len(tokenizer.encode(QUERY)) + sum(map(len, ids))
    stack.wait_idle()


def test_rerank_orders_by_relevance(disagg_stack: Stack, cosines: list[float]) -> None:
    want = sorted(range(len(DOCS)), key=lambda i: -cosines[i])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = _post(disagg_stack, path, {"model": MODEL_NAME, "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [x["index"] for x in body["results"]] == want, path
        assert [x["relevance_score"] for x in body["results"]] == pytest.approx(
            [cosines[i] for i in want], abs=TOL)
        assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in want]
        assert body["usage"]["total_tokens"] > 0 and body["model"] == MODEL_NAME
    r = _post(disagg_stack, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2,
                                           "return_documents": False})
    assert r.status_code == 200, r.text
    top = r.json()["results"]
    assert [x["index"] for x in top] == want[:2] and all("document" not in x for x in top)
    disagg_stack.wait_idle()


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1",
     "give one text_1, or as many as text_2"),
    ("/v1/score", {"text_1": "a"}, "text_2", "text_2 is required"),
    ("/v1/score", {"text_1": "a", "text_2": [[1, 2], [3, -4]]}, "text_2.1",
     "token ids must be in"),
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents", "non-empty list"),
    ("/v1/rerank", {"documents": DOCS}, "query", "query is required"),
    ("/v1/rerank", {"query": QUERY, "documents": [5, 6, 7]}, "documents", "wrap it in a list"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n", "top_n"),
])
def test_bad_requests_are_400s(disagg_stack: Stack, path: str, body: dict, param: str,
                               message: str) -> None:
    r = _post(disagg_stack, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    r = _post(disagg_stack, path, {**body, "model": "no-such-model"})
    assert r.status_code in (400, 404)
    disagg_stack.wait_idle()


def test_grpc_score_is_the_cosine(disagg_stack: Stack, cosines: list[float]) -> None:
    import grpc

    from protos.splitserve.v1 import gateway_pb2, gateway_pb2_grpc

    with grpc.insecure_channel(disagg_stack.grpc_target) as channel:
        scored = gateway_pb2_grpc.GatewayStub(channel).Score(gateway_pb2.ScoreRequest(
            text_1=[gateway_pb2.EmbeddingInput(text=QUERY)],
            text_2=[gateway_pb2.EmbeddingInput(text=d) for d in DOCS]), timeout=120)
    assert list(scored.scores) == pytest.approx(cosines, abs=TOL)
    disagg_stack.wait_idle()
