"""vLLM's score and rerank APIs over an embedding model: `POST /v1/score` (`/score`) and
`POST /v1/rerank` (`/rerank`, `/v2/rerank`, the Jina / Cohere shape).

A score is the cosine similarity of two texts' embeddings, as vLLM computes it for embedding
(bi-encoder) models: every distinct text is embedded once (`run_embeddings`: the same
routing, limits, tracing and cancellation as `/v1/embeddings`), normalized by the workers, and
each pair's score is the dot product of its two vectors. Cross-encoder models (a
classification head over the concatenated pair) are not served here: this engine has no
classification heads, so only this bi-encoder form exists.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from gateway.embeddings import embedding_job, run_embeddings
from gateway.errors import GatewayError
from gateway.openai_protocol import PromptInput, RerankRequest, ScoreRequest, prompt_inputs
from gateway.state import GatewayState
from protos.embedding_wire import unpack_float32

Until = Callable[[Awaitable[list[Any]]], Awaitable[list[Any]]]


def score_pairs(text_1: Sequence[PromptInput], text_2: Sequence[PromptInput]
                ) -> list[tuple[int, int]]:
    """(index into text_1, index into text_2) of each score, in the response's order."""
    if len(text_1) == 1:
        return [(0, j) for j in range(len(text_2))]
    if len(text_1) != len(text_2):
        raise GatewayError.invalid("text_1", f"text_1 holds {len(text_1)} texts and text_2 "
                                   f"{len(text_2)}: give one text_1, or as many as text_2")
    return [(i, i) for i in range(len(text_1))]


async def score_body(state: GatewayState, req: ScoreRequest, lora: str, until: Until
                     ) -> dict[str, Any]:
    """The `/v1/score` response: `data[i].score` for each pair of `score_pairs`."""
    limit = state.config.max_embedding_inputs
    text_1 = prompt_inputs(req.text_1, limit, "text_1")
    text_2 = prompt_inputs(req.text_2, limit, "text_2")
    pairs = score_pairs(text_1, text_2)
    vectors, tokens = await _embed_distinct(state, [*text_1, *text_2], req, lora, "score",
                                            ["text_1"] * len(text_1) + ["text_2"] * len(text_2),
                                            until)
    first, second = vectors[:len(text_1)], vectors[len(text_1):]
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": lora or state.config.served_model_name,
            "data": [{"index": k, "object": "score", "score": _dot(first[i], second[j])}
                     for k, (i, j) in enumerate(pairs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def rerank_body(state: GatewayState, req: RerankRequest, lora: str, until: Until
                      ) -> dict[str, Any]:
    """The `/v1/rerank` response: results by descending relevance, each naming its document's
    index in the request (ties keep the request's order)."""
    if req.query is None or req.query == "" or req.query == []:
        raise GatewayError.invalid("query", "query is required")
    if not isinstance(req.documents, list) or not req.documents:
        raise GatewayError.invalid("documents", "documents must be a non-empty list of strings "
                                   "or of lists of token ids")
    docs = prompt_inputs(req.documents, state.config.max_embedding_inputs - 1, "documents")
    if len(docs) == 1 and len(req.documents) > 1:  # a flat list of ids read as one document
        raise GatewayError.invalid("documents", "documents must be a list of documents (a list "
                                   "of token ids is one document: wrap it in a list)")
    query = prompt_inputs(req.query, 1, "query")
    vectors, tokens = await _embed_distinct(state, [*query, *docs], req, lora, "rerank",
                                            ["query"] + ["documents"] * len(docs), until)
    scores = [_dot(vectors[0], v) for v in vectors[1:]]
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    top = order[:req.top_n] if req.top_n else order
    results = []
    for i in top:
        row: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            doc = docs[i]
            row["document"] = {"text": doc} if isinstance(doc, str) else {"tokens": doc}
        results.append(row)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": lora or state.config.served_model_name,
            "usage": {"total_tokens": tokens}, "results": results}


async def _embed_distinct(state: GatewayState, inputs: list[PromptInput],
                          req: ScoreRequest | RerankRequest, lora: str, kind: str,
                          params: list[str], until: Until) -> tuple[list[list[float]], int]:
    """Each input's unit embedding and the prompt tokens embedded. Every input is tokenized
    and checked first (`params[i]` names input i in errors, e.g. "text_2.3"); a prompt given
    twice is embedded once."""
    pre = state.preprocessor
    counts: dict[str, int] = {}
    for param in params:
        counts[param] = counts.get(param, 0) + 1
    seen: dict[str, int] = {}
    distinct: dict[tuple[int, ...], int] = {}
    index = []
    for prompt, param in zip(inputs, params, strict=True):
        i = seen[param] = seen.get(param, -1) + 1
        name = param if counts[param] == 1 else f"{param}.{i}"
        ids = (await pre.encode_text(prompt, name) if isinstance(prompt, str)
               else pre.check_token_ids(prompt, name))
        ids = pre.truncated(ids, req.truncate_prompt_tokens)
        pre.check_prompt_len(len(ids), name, generates=False)
        index.append(distinct.setdefault(tuple(ids), len(distinct)))
    job = await embedding_job(state, [list(ids) for ids in distinct],
                              request_id=f"{kind}-{uuid.uuid4().hex}", lora_name=lora,
                              priority=req.priority, normalize=True)
    state.metrics.requests_received.labels(api=kind).inc()
    state.metrics.prompt_tokens.inc(job.num_prompt_tokens)
    responses = await until(run_embeddings(state, job))
    vectors = [unpack_float32(r.embedding) for r in responses]
    return [vectors[k] for k in index], job.num_prompt_tokens


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of two unit vectors (their dot product, clamped against rounding)."""
    return max(-1.0, min(1.0, math.fsum(x * y for x, y in zip(a, b, strict=True))))
