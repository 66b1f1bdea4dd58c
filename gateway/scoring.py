"""vLLM's score, rerank and classify APIs: `POST /v1/score` (`/score`), `POST /v1/rerank`
(`/rerank`, `/v2/rerank`, the Jina / Cohere shape) and `POST /v1/classify` (`/classify`).

What a score is depends on the model the workers serve (their load reports' `class_labels`):

- an embedding model (bi-encoder): the cosine similarity of the two texts' embeddings. Every
  distinct text is embedded once (`run_embeddings`: the same routing, limits, tracing and
  cancellation as `/v1/embeddings`), normalized by the workers, and each pair's score is the
  dot product of its two vectors;
- a one-label classifier (cross-encoder: a `*ForSequenceClassification` checkpoint with one
  label, or `--classifier-from-token no,yes`): the pair read as one input (the tokenizer's pair
  template, `Tokenizer.encode_pair`; token ids one list after the other), its label's logit
  through a sigmoid. Each distinct pair runs once.

A classifier with more labels classifies (`/v1/classify`: softmax probabilities and the most
likely label) and scores nothing.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from engine_api.classify import probabilities
from gateway.embeddings import embedding_job, run_embeddings
from gateway.errors import GatewayError
from gateway.openai_protocol import (
    ClassifyRequest,
    PromptInput,
    RerankRequest,
    ScoreRequest,
    prompt_inputs,
)
from gateway.state import GatewayState
from rpc.embedding_wire import unpack_float32

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
    if _cross_encoder(state):
        names_1, names_2 = _names("text_1", len(text_1)), _names("text_2", len(text_2))
        scores, tokens = await _cross_scores(
            state, [_Side(text_1[i], names_1[i], text_2[j], names_2[j]) for i, j in pairs],
            req, lora, "score", until)
    else:
        vectors, tokens = await _embed_distinct(
            state, [*text_1, *text_2], req, lora, "score",
            ["text_1"] * len(text_1) + ["text_2"] * len(text_2), until)
        first, second = vectors[:len(text_1)], vectors[len(text_1):]
        scores = [_dot(first[i], second[j]) for i, j in pairs]
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": lora or state.config.served_model_name,
            "data": [{"index": k, "object": "score", "score": score}
                     for k, score in enumerate(scores)],
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
    if _cross_encoder(state):
        names = _names("documents", len(docs))
        scores, tokens = await _cross_scores(
            state, [_Side(query[0], "query", doc, names[i]) for i, doc in enumerate(docs)],
            req, lora, "rerank", until)
    else:
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
    prompts: list[list[int]] = []
    for prompt, param in zip(inputs, params, strict=True):
        i = seen[param] = seen.get(param, -1) + 1
        name = param if counts[param] == 1 else f"{param}.{i}"
        ids = (await pre.encode_text(prompt, name) if isinstance(prompt, str)
               else pre.check_token_ids(prompt, name))
        ids = pre.truncated(ids, req.truncate_prompt_tokens)
        pre.check_prompt_len(len(ids), name, generates=False)
        prompts.append(ids)
    return await _pool_distinct(state, prompts, req, lora, kind, until, normalize=True)


async def _pool_distinct(state: GatewayState, prompts: list[list[int]],
                         req: ScoreRequest | RerankRequest, lora: str, kind: str, until: Until,
                         normalize: bool | None = None) -> tuple[list[list[float]], int]:
    """Each checked prompt's pooled output (an embedding, or a classifier's logits) and the
    prompt tokens run; a prompt given twice runs once. Counted as one `kind` request."""
    distinct: dict[tuple[int, ...], int] = {}
    index = [distinct.setdefault(tuple(ids), len(distinct)) for ids in prompts]
    job = await embedding_job(state, [list(ids) for ids in distinct],
                              request_id=f"{kind}-{uuid.uuid4().hex}", lora_name=lora,
                              priority=req.priority, normalize=normalize)
    state.metrics.requests_received.labels(api=kind).inc()
    state.metrics.prompt_tokens.inc(job.num_prompt_tokens)
    responses = await until(run_embeddings(state, job))
    vectors = [unpack_float32(r.embedding) for r in responses]
    return [vectors[k] for k in index], job.num_prompt_tokens


async def classify_body(state: GatewayState, req: ClassifyRequest, lora: str, until: Until
                        ) -> dict[str, Any]:
    """The `/v1/classify` response: per input its labels' probabilities (softmax; a lone
    label's sigmoid) and the most likely label."""
    labels = state.class_labels()
    if labels == ():
        raise GatewayError.invalid("model", "this model is not a classifier (it embeds): "
                                   "/v1/classify needs a *ForSequenceClassification checkpoint "
                                   "or workers started with --classifier-from-token")
    inputs = prompt_inputs(req.input, state.config.max_embedding_inputs, "input")
    job = await embedding_job(state, inputs, request_id=f"classify-{uuid.uuid4().hex}",
                              lora_name=lora, priority=req.priority,
                              truncate_prompt_tokens=req.truncate_prompt_tokens)
    state.metrics.requests_received.labels(api="classify").inc()
    state.metrics.prompt_tokens.inc(job.num_prompt_tokens)
    responses = await until(run_embeddings(state, job))
    data = []
    for index, response in enumerate(responses):
        logits = unpack_float32(response.embedding)
        names = labels or tuple(f"LABEL_{i}" for i in range(len(logits)))
        if len(names) != len(logits):
            raise _worker_mismatch(f"a worker returned {len(logits)} class logits for "
                                   f"{len(names)} labels (workers disagree on the model)")
        probs = probabilities(logits)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": index, "label": names[best], "probs": probs,
                     "num_classes": len(probs)})
    return {"id": job.request_id, "object": "list", "created": int(time.time()),
            "model": lora or state.config.served_model_name, "data": data,
            "usage": {"prompt_tokens": job.num_prompt_tokens, "completion_tokens": 0,
                      "total_tokens": job.num_prompt_tokens}}


def _worker_mismatch(message: str) -> GatewayError:
    """A worker's reply that does not fit the model the pool reported: a 503 (the pool is in
    the middle of a change of model, or misconfigured), not the client's fault."""
    return GatewayError(grpc.StatusCode.UNAVAILABLE, message)


def _cross_encoder(state: GatewayState) -> bool:
    """Whether scores come from a one-label classifier (else embeddings' cosines); a 400 for a
    classifier of several labels, which has no score."""
    labels = state.class_labels()
    if labels and len(labels) != 1:
        raise GatewayError.invalid("model", f"this model classifies into {len(labels)} labels: "
                                   "scores need an embedding model or a one-label classifier "
                                   "(a cross-encoder); use /v1/classify")
    return bool(labels)


def _names(param: str, n: int) -> list[str]:
    """How input i of `param` is named in errors: `param` alone, else `param.i`."""
    return [param] if n == 1 else [f"{param}.{i}" for i in range(n)]


@dataclass(frozen=True)
class _Side:
    """One pair of a cross-encoder: the two inputs and their names in errors."""

    first: PromptInput
    first_name: str
    second: PromptInput
    second_name: str


async def _cross_scores(state: GatewayState, pairs: list[_Side],
                        req: ScoreRequest | RerankRequest, lora: str, kind: str, until: Until
                        ) -> tuple[list[float], int]:
    """Each pair's cross-encoder score (the sigmoid of the one label's logit) and the prompt
    tokens run. Texts are tokenized as a pair; token ids are joined as given (both sides must
    be of one kind). Every pair is checked before any runs; a pair given twice runs once."""
    pre = state.preprocessor
    prompts: list[list[int]] = []
    for p in pairs:
        if isinstance(p.first, str) and isinstance(p.second, str):
            ids = await pre.encode_pair(p.first, p.second, p.first_name, p.second_name)
        elif isinstance(p.first, list) and isinstance(p.second, list):
            ids = [*pre.check_token_ids(p.first, p.first_name),
                   *pre.check_token_ids(p.second, p.second_name)]
        else:
            raise GatewayError.invalid(p.second_name, f"{p.first_name} and {p.second_name} must "
                                       "both be texts or both token ids for a cross-encoder")
        ids = pre.truncated(ids, req.truncate_prompt_tokens)
        pre.check_prompt_len(len(ids), p.second_name, generates=False)
        prompts.append(ids)
    outputs, tokens = await _pool_distinct(state, prompts, req, lora, kind, until)
    scores = []
    for logits in outputs:
        if len(logits) != 1:
            raise _worker_mismatch(f"a worker returned {len(logits)} class logits for a "
                                   "one-label cross-encoder (workers disagree on the model)")
        scores.append(probabilities(logits)[0])
    return scores, tokens


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of two unit vectors (their dot product, clamped against rounding)."""
    return max(-1.0, min(1.0, math.fsum(x * y for x, y in zip(a, b, strict=True))))
