"""Decode reuses its own prefix cache for KV that arrives from a prefill worker: a repeated
prompt pulls only its tail (the last full block, hash-checked, and the partial block), and the
output is still the colocated oracle's, token for token. A colocated stack reports its prefix
hits as the OpenAI usage's cached tokens."""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")

from openai import OpenAI  # noqa: E402

from tests.support.e2e_stack import MODEL_NAME, Stack, generate  # noqa: E402
from worker.kv import GrpcKvLoader  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

MAX_TOKENS = 6


def test_repeated_prompt_pulls_only_its_tail(disagg_stack: Stack, colocated_stack: Stack) -> None:
    decode = disagg_stack.workers["decode"]
    assert decode.aengine is not None
    loader = decode.aengine.kv_loader
    assert isinstance(loader, GrpcKvLoader)
    block_size = decode.aengine.engine.config.cache.block_size
    # A prompt of 7 full blocks + 5 tokens that no other test uses (token ids below 1000 + 11).
    prompt = [11 + (i * 37) % 997 for i in range(7 * block_size + 5)]
    num_blocks = 8
    want = generate(colocated_stack.grpc_target, prompt, MAX_TOKENS).token_ids

    pulled, reused = loader.blocks_pulled, loader.blocks_reused
    first = generate(disagg_stack.grpc_target, prompt, MAX_TOKENS).token_ids
    assert first == want
    assert (loader.blocks_pulled - pulled, loader.blocks_reused - reused) == (num_blocks, 0)

    pulled, reused = loader.blocks_pulled, loader.blocks_reused
    second = generate(disagg_stack.grpc_target, prompt, MAX_TOKENS).token_ids
    assert second == want
    # 6 of the 7 full blocks come from decode's own cache; the last full one (its hash proves
    # the lease holds this prompt) and the partial one travel.
    assert (loader.blocks_pulled - pulled, loader.blocks_reused - reused) == (2, 6)
    disagg_stack.wait_idle()


def test_colocated_usage_counts_prefix_cache_hits(colocated_stack: Stack) -> None:
    engine = colocated_stack.workers["colocated"].aengine
    assert engine is not None
    block_size = engine.engine.config.cache.block_size
    prompt = [13 + (i * 41) % 991 for i in range(5 * block_size + 3)]  # no other test's
    client = OpenAI(base_url=colocated_stack.rest_url, api_key="unused", max_retries=0)
    cached = []
    for _ in range(2):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2,
                                      temperature=0)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached == [0, 5 * block_size]  # the second finds the 5 full blocks
    colocated_stack.wait_idle()
