"""Disaggregated greedy output equals colocated output token for token (colocated is the oracle:
docs/architecture.md), one by one, all at once, and with 32+ concurrent streaming REST clients."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

from openai import OpenAI  # noqa: E402

from tests.support.e2e_stack import (  # noqa: E402
    BLOCK_SIZE,
    MODEL_NAME,
    ORACLE_MAX_TOKENS,
    Generated,
    Stack,
    generate_many,
)

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

NUM_CONCURRENT_STREAMS = 32


def _diff(name: str, got: list[Generated], want: list[Generated]) -> list[str]:
    return [f"{name} prompt {i}: {g.token_ids} != {w.token_ids}"
            for i, (g, w) in enumerate(zip(got, want, strict=True)) if g.token_ids != w.token_ids]


def test_prompts_span_blocks(prompts: list[list[int]]) -> None:
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) == 12
    assert lengths[0] < BLOCK_SIZE < lengths[len(lengths) // 2]
    assert lengths[-1] > 300  # multi-hundred tokens: many blocks to transfer


def test_oracle_is_complete(oracle: list[Generated]) -> None:
    assert all(len(g.token_ids) == ORACLE_MAX_TOKENS for g in oracle)
    assert len({tuple(g.token_ids) for g in oracle}) > 10  # the prompts really differ


def test_disagg_equals_colocated_one_by_one(disagg_stack: Stack, prompts: list[list[int]],
                                            oracle: list[Generated]) -> None:
    got = generate_many(disagg_stack.grpc_target, prompts, ORACLE_MAX_TOKENS, concurrent=False)
    assert not _diff("disagg sequential", got, oracle)
    assert [g.complete.usage.prompt_tokens for g in got] == [len(p) for p in prompts]
    disagg_stack.wait_idle()


def test_disagg_equals_colocated_all_at_once(disagg_stack: Stack, prompts: list[list[int]],
                                             oracle: list[Generated]) -> None:
    got = generate_many(disagg_stack.grpc_target, prompts, ORACLE_MAX_TOKENS, concurrent=True)
    assert not _diff("disagg concurrent", got, oracle)
    disagg_stack.wait_idle()


def test_colocated_batched_equals_colocated_one_by_one(colocated_stack: Stack,
                                                       prompts: list[list[int]],
                                                       oracle: list[Generated]) -> None:
    got = generate_many(colocated_stack.grpc_target, prompts, ORACLE_MAX_TOKENS, concurrent=True)
    assert not _diff("colocated concurrent", got, oracle)
    colocated_stack.wait_idle()


def _stream_completion(client: OpenAI, prompt: list[int]) -> tuple[str, int, str | None]:
    """(text, completion_tokens from usage, finish_reason) of one streamed completion."""
    text, usage, finish = "", -1, None
    for chunk in client.completions.create(
            model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=ORACLE_MAX_TOKENS,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return text, usage, finish


def test_many_concurrent_streams(disagg_stack: Stack, prompts: list[list[int]],
                                 oracle: list[Generated]) -> None:
    client = OpenAI(base_url=disagg_stack.rest_url, api_key="x", max_retries=0, timeout=180)
    picks = [i % len(prompts) for i in range(NUM_CONCURRENT_STREAMS)]
    with ThreadPoolExecutor(max_workers=NUM_CONCURRENT_STREAMS) as pool:
        results = list(pool.map(lambda i: _stream_completion(client, prompts[i]), picks))
    wrong = [f"stream {n} (prompt {i}): {got!r} != {oracle[i].text!r}"
             for n, (i, (got, _, _)) in enumerate(zip(picks, results, strict=True))
             if got != oracle[i].text]
    assert not wrong, wrong
    assert all(u == ORACLE_MAX_TOKENS and f == "length" for _, u, f in results), results
    disagg_stack.wait_idle()
