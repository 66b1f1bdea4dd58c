"""What a scored prompt's logprobs cost a worker's event loop on the way out (CPU).

A prefill worker turns a scored prompt (`SamplingParams.prompt_logprobs`) into its response on
its event loop, and the gateway reads it back. Two wire forms, timed building the message from
the engine's lists, serializing it, and parsing it back (what the gateway does):

- `per_token`: a `TokenLogprob` message per prompt token with its top entries as messages (the
  form the protos first had: `repeated TokenLogprob prompt_logprobs`; encoded here in
  `GenerateChunk.logprobs`, a field of that same type);
- `columnar`: one `PromptLogprobs` message of packed columns (the form they have).

Then what the gateway's REST layer does with one on its event loop: the `echo` logprobs of
`/v1/completions` and vLLM's `prompt_logprobs` entries, with the SmolLM2 tokenizer, each token's
text decoded once per id (`TokenTexts`: a first request, "cold", pays each new id's decode; a
later one finds them), and the JSON encoding of the result.

Usage: PYTHONPATH=. python3 tools/probes/probe_scored_wire.py --out F [--tokens 4095] [--repeats 20]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.results import cpu_name, git_info
from protos.splitserve.v1 import common_pb2, gateway_pb2


def _per_token(ids: list[int], lps: list[float], ranks: list[int], top_ids: list[int],
               top_lps: list[float], k: int) -> bytes:
    del ranks  # (its rank field is gone with it)
    msgs = [common_pb2.TokenLogprob(token_id=t, logprob=lp, top=[
        common_pb2.TopLogprob(token_id=top_ids[i * k + j], logprob=top_lps[i * k + j])
        for j in range(k)]) for i, (t, lp) in enumerate(zip(ids, lps, strict=True))]
    return gateway_pb2.GenerateChunk(logprobs=msgs).SerializeToString()


def _parse_per_token(data: bytes) -> int:
    return sum(1 + len(m.top) for m in gateway_pb2.GenerateChunk.FromString(data).logprobs)


def _columnar(ids: list[int], lps: list[float], ranks: list[int], top_ids: list[int],
              top_lps: list[float], k: int) -> bytes:
    return common_pb2.PromptLogprobs(num_top=k, token_ids=ids, logprobs=lps, ranks=ranks,
                                     top_token_ids=top_ids, top_logprobs=top_lps
                                     ).SerializeToString()


def _parse_columnar(data: bytes) -> int:
    msg = common_pb2.PromptLogprobs.FromString(data)
    return len(list(msg.logprobs)) + len(list(msg.top_logprobs))


def _rest(n: int, repeats: int) -> dict[str, Any]:
    from gateway.openai_bodies import echo_logprobs, prompt_logprobs_entries
    from gateway.tokenization import TokenTexts, load_tokenizer

    tokenizer = load_tokenizer("")
    ids = [(7 * i) % 40_000 + 5 for i in range(n + 1)]
    out: dict[str, Any] = {}
    for k in (1, 5):
        scored = common_pb2.PromptLogprobs(
            num_top=k, token_ids=ids[1:], logprobs=[-1.5] * n, ranks=[2] * n,
            top_token_ids=[(13 * i) % 40_000 for i in range(n * k)], top_logprobs=[-0.5] * (n * k))
        cold = TokenTexts(tokenizer)
        t = time.perf_counter()
        echo_logprobs(ids, scored, cold, k)
        cold_ms = (time.perf_counter() - t) * 1e3
        warm = functools.partial(echo_logprobs, ids, scored, cold, k)
        entries = functools.partial(prompt_logprobs_entries, scored, cold, k)
        body = echo_logprobs(ids, scored, cold, k)
        out[f"top_{k}"] = {
            "echo_cold_ms": round(cold_ms, 3), "echo_ms": _median_ms(warm, repeats),
            "vllm_entries_ms": _median_ms(entries, repeats),
            "echo_json_ms": _median_ms(functools.partial(json.dumps, body), repeats)}
    return out


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=4095)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    n = args.tokens
    results: dict[str, Any] = {}
    for k in (0, 1, 5, 20):
        cols = (list(range(n)), [-1.5] * n, [3] * n, list(range(n * k)), [-0.5] * (n * k), k)
        per_token = _per_token(*cols)
        columnar = _columnar(*cols)
        results[f"top_{k}"] = {
            "per_token_build_serialize_ms": _median_ms(functools.partial(_per_token, *cols),
                                                       args.repeats),
            "columnar_build_serialize_ms": _median_ms(functools.partial(_columnar, *cols),
                                                      args.repeats),
            "per_token_parse_ms": _median_ms(functools.partial(_parse_per_token, per_token),
                                             args.repeats),
            "columnar_parse_ms": _median_ms(functools.partial(_parse_columnar, columnar),
                                            args.repeats),
            "per_token_bytes": len(per_token), "columnar_bytes": len(columnar)}
    results["rest"] = _rest(n, args.repeats)
    doc = {**git_info(), "cpu": cpu_name(), "tokens": n, "repeats": args.repeats,
           "results": results,
           "command": "PYTHONPATH=. python3 tools/probes/probe_scored_wire.py --out F"}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
