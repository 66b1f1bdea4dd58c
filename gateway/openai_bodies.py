"""OpenAI wire format, the responses' side: bodies built as plain dicts in the exact shape the
`openai` Python package parses — usage, embeddings, errors, and logprobs in the completions',
chat's and vLLM's prompt forms."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from protos.splitserve.v1 import common_pb2
from rpc.embedding_wire import unpack_float32


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def embeddings_body(embeddings: Sequence[bytes], num_prompt_tokens: int, model: str,
                    encoding_format: str) -> dict[str, Any]:
    """OpenAI's embeddings response from packed little-endian float32 vectors: each a list of
    floats, or ("base64") those very bytes in base64, as OpenAI encodes them."""
    def encoded(packed: bytes) -> list[float] | str:
        if encoding_format == "base64":
            return base64.b64encode(packed).decode("ascii")
        return unpack_float32(packed)

    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encoded(e)}
                     for i, e in enumerate(embeddings)],
            "model": model,
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}}


def error_body(message: str, type_: str, param: str | None, code: str | int | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


TokenText = Callable[[int], str]
# A token's id, its logprob and its top alternatives (id, logprob).
LogprobRow = tuple[int, float, Sequence[tuple[int, float]]]


def logprob_rows(logprobs: Sequence[common_pb2.TokenLogprob]) -> Iterator[LogprobRow]:
    for lp in logprobs:
        yield lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]


def completion_logprobs(rows: Iterable[LogprobRow], token_text: TokenText,
                        text_offset_start: int = 0) -> dict[str, Any]:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset_start
    for token_id, logprob, top_pairs in rows:
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(logprob)
        top = {token_text(t): v for t, v in top_pairs}
        top.setdefault(text, logprob)  # the sampled token is always listed (as vLLM)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def _scored_rows(scored: common_pb2.PromptLogprobs, num_top: int
                 ) -> Iterator[tuple[int, float, int, list[tuple[int, float]]]]:
    """(token id, logprob, rank, its first `num_top` top entries) per scored prompt token."""
    k = scored.num_top
    top_ids, top_lps = scored.top_token_ids, scored.top_logprobs
    n = min(k, num_top)
    for i, (token, logprob, rank) in enumerate(zip(scored.token_ids, scored.logprobs,
                                                    scored.ranks, strict=True)):
        yield token, logprob, rank, list(zip(top_ids[i * k:i * k + n],
                                             top_lps[i * k:i * k + n], strict=True))


def echo_logprobs(prompt_ids: Sequence[int], scored: common_pb2.PromptLogprobs,
                  token_text: TokenText, num_top: int) -> dict[str, Any]:
    """Legacy completions logprobs of an echoed prompt (`echo` with `logprobs`): its first token
    has none (null), the others are scored given the tokens before them; each position lists
    its `num_top` most likely tokens and the prompt's own."""
    first = token_text(prompt_ids[0])
    out = completion_logprobs(((t, lp, top) for t, lp, _, top in _scored_rows(scored, num_top)),
                              token_text, len(first))
    return {"tokens": [first, *out["tokens"]],
            "token_logprobs": [None, *out["token_logprobs"]],
            "top_logprobs": [None, *out["top_logprobs"]],
            "text_offset": [0, *out["text_offset"]]}


def prompt_logprobs_entries(scored: common_pb2.PromptLogprobs, token_text: TokenText,
                            num_top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, then a map from token id
    (a string: JSON keys) to {logprob, rank, decoded_token} holding the prompt's token and
    the `num_top` most likely ones."""
    def entry(logprob: float, rank: int, token_id: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(token_id)}

    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token, logprob, rank, top in _scored_rows(scored, num_top):
        item = {str(token): entry(logprob, rank, token)}
        for i, (t, v) in enumerate(top):
            item.setdefault(str(t), entry(v, i + 1, t))
        out.append(item)
    return out


def chat_logprobs(logprobs: Sequence[common_pb2.TokenLogprob], token_text: TokenText,
                  num_top: int) -> dict[str, Any]:
    """Chat logprobs: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for lp in logprobs:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(t.token_id, t.logprob) for t in lp.top[:num_top]]
        content.append(item)
    return {"content": content}
