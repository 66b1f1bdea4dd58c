"""vLLM's `cache_salt`: a prompt's KV is shared only among requests with the same salt.

Engine (tiny model, prefix caching): the same prompt hits the cache under its own salt only,
with the same greedy tokens either way. Stack (real SmolLM2 workers, disaggregated): the REST
`cache_salt` reaches both workers, whose prefix caches and the prefill-to-decode handoff honour
it (a handle made under one salt is refused under another); `cached_tokens` shows the hits.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import grpc
import httpx
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")


from engine_api.errors import EngineInputError  # noqa: E402
from protos.splitserve.v1 import (  # noqa: E402
    decode_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.support.e2e_stack import MODEL_NAME, Stack, greedy_sampling, worker_channel  # noqa: E402
from tests.support.engine_driver import greedy, tiny_llm  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
PROMPT = [(7 * j + 3) % 380 + 2 for j in range(40)]


def test_the_engine_shares_kv_within_a_salt(tiny_model_dirs: dict[str, Path]) -> None:
    llm = tiny_llm(tiny_model_dirs["llama"])

    def run(salt: str | None) -> tuple[list[int], int]:
        prompt: dict = {"prompt_token_ids": PROMPT}
        if salt is not None:
            prompt["cache_salt"] = salt
        [out] = llm.generate(prompt, greedy(4))
        return out.outputs[0].token_ids, out.num_cached_tokens

    tokens, cached = run("tenant-a")
    assert cached == 0
    again, hit = run("tenant-a")
    assert again == tokens and hit > 0
    assert run("tenant-b") == (tokens, 0)
    assert run(None) == (tokens, 0)          # the unsalted cache is another namespace too
    assert run(None)[1] > 0
    for bad in ("", "x" * 257):
        with pytest.raises(EngineInputError, match="cache_salt"):
            run(bad)


@pytest.mark.slow
def test_the_stack_honours_the_salt(disagg_stack: Stack) -> None:
    text = f"Tell me something about the number {uuid.uuid4().int % 10**9} please, in detail."

    def call(salt: str | None) -> tuple[str, int]:
        body: dict = {"model": MODEL_NAME, "prompt": text, "max_tokens": 4, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = httpx.post(disagg_stack.rest_url + "/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

    first, cached = call("tenant-a")
    assert cached == 0
    again, hit = call("tenant-a")
    assert again == first and hit > 0
    assert call("tenant-b") == (first, 0)
    assert call(None) == (first, 0)
    r = httpx.post(disagg_stack.rest_url + "/completions", json={
        "model": MODEL_NAME, "prompt": text, "cache_salt": ""}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    disagg_stack.wait_idle()


@pytest.mark.slow
def test_a_handle_is_bound_to_its_salt(disagg_stack: Stack) -> None:
    prompt = disagg_stack.tokenizer.encode(f"Salted handoff {uuid.uuid4().hex}: a, b, c, d.")
    with worker_channel(disagg_stack, "prefill") as ch:
        resp = prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
            request_id=f"p-{uuid.uuid4().hex}", prompt_token_ids=prompt,
            sampling=greedy_sampling(4), cache_salt="tenant-a"), timeout=120)
        assert resp.HasField("kv_handle")

        def decode(salt: str) -> decode_pb2.DecodeComplete:
            request = decode_pb2.DecodeRequest(
                request_id=f"d-{uuid.uuid4().hex}", prompt_token_ids=prompt,
                output_token_ids=[resp.first_token_id], sampling=greedy_sampling(4),
                kv_failure_policy=decode_pb2.KV_FAILURE_POLICY_FAIL, cache_salt=salt)
            request.kv_handle.CopyFrom(resp.kv_handle)
            with worker_channel(disagg_stack, "decode") as dch:
                out = list(decode_pb2_grpc.DecodeStub(dch).Decode(request, timeout=120))
            return out[-1].complete

        with pytest.raises(grpc.RpcError) as info:
            decode("tenant-b")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cache salt" in str(info.value.details())
        done = decode("tenant-a")              # the same salt: pulled, not recomputed
        assert not done.kv_recomputed
        kv_transfer_pb2_grpc.KvTransferStub(ch).Release(  # a no-op once decode acknowledged
            kv_transfer_pb2.ReleaseRequest(request_id=resp.kv_handle.request_id), timeout=60)
    disagg_stack.wait_idle()


@pytest.mark.slow
def test_embeddings_are_salted(disagg_stack: Stack) -> None:
    """LAST pooling takes prefix hits, within its salt only (the worker's own count)."""
    from protos.splitserve.v1 import common_pb2

    prompt = disagg_stack.tokenizer.encode(f"Embed me {uuid.uuid4().hex}, a long enough text.")

    def embed(salt: str) -> int:
        with worker_channel(disagg_stack, "prefill") as ch:
            out = prefill_pb2_grpc.PrefillStub(ch).Embed(common_pb2.EmbedRequest(
                request_id=f"e-{uuid.uuid4().hex}", prompt_token_ids=prompt,
                cache_salt=salt), timeout=120)
        return out.num_cached_tokens

    assert embed("tenant-a") == 0
    assert embed("tenant-a") > 0
    assert embed("tenant-b") == 0
    r = httpx.post(disagg_stack.rest_url + "/embeddings", json={
        "model": MODEL_NAME, "input": "hello", "cache_salt": "tenant-a"}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(disagg_stack.rest_url + "/embeddings", json={
        "model": MODEL_NAME, "input": "hello", "cache_salt": "x" * 300}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    disagg_stack.wait_idle()
