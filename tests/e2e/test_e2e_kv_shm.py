"""Disaggregated serving with the KV coming through shared memory (the way a decode worker on
the prefill worker's host takes when the data port cannot be reached; the default disaggregated
stack takes the data port): the real SmolLM2 workers, greedy output equal to colocated's token
for token, and the decode worker's totals saying every pull came that way."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

from tests.support.e2e_stack import (  # noqa: E402
    ORACLE_MAX_TOKENS,
    Generated,
    LoopThread,
    Stack,
    generate_many,
    start_stack,
)

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shm_stack(loop_thread: LoopThread) -> Iterator[Stack]:
    """Gateway → prefill + decode, the decode worker allowed only shared memory (and the
    stream, always kept: a pull that fell back to it would show in the totals)."""
    stack = start_stack(loop_thread, colocated=False, kv_transports=("shm", "stream"))
    yield stack
    stack.stop()


def test_kv_through_shared_memory_equals_colocated(shm_stack: Stack, prompts: list[list[int]],
                                                   oracle: list[Generated]) -> None:
    got = generate_many(shm_stack.grpc_target, prompts, ORACLE_MAX_TOKENS, concurrent=True)
    diff = [i for i, (g, w) in enumerate(zip(got, oracle, strict=True))
            if g.token_ids != w.token_ids]
    assert not diff, f"prompts {diff} differ from colocated"
    shm_stack.wait_idle()  # also: no lease left on the prefill worker, no block leaked
    decode = shm_stack.workers["decode"]
    assert decode.aengine is not None
    stats = dict(decode.aengine.kv_loader.transport_stats)  # type: ignore[union-attr]
    assert set(stats) == {"shm"}, stats
    assert stats["shm"].pulls >= len(prompts) // 2 and stats["shm"].bytes > 0
