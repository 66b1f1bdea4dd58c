"""Disaggregated serving with the KV coming over the prefill worker's data port (raw TCP, the
way between hosts): the real SmolLM2 workers, greedy output equal to colocated's token for
token, and the decode worker's totals saying every pull came that way."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.register_assert_rewrite("e2e_stack")  # before the import below: its asserts explain

from e2e_stack import (  # noqa: E402
    ORACLE_MAX_TOKENS,
    Generated,
    LoopThread,
    Stack,
    generate_many,
    start_stack,
)

pytest_plugins = ["e2e_stack"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tcp_stack(loop_thread: LoopThread) -> Iterator[Stack]:
    """Gateway → prefill + decode, the decode worker allowed only the data port (and the
    stream, always kept: a pull that fell back to it would show in the totals)."""
    stack = start_stack(loop_thread, colocated=False, kv_transports=("tcp", "stream"))
    yield stack
    stack.stop()


def test_kv_over_the_data_port_equals_colocated(tcp_stack: Stack, prompts: list[list[int]],
                                                oracle: list[Generated]) -> None:
    got = generate_many(tcp_stack.grpc_target, prompts, ORACLE_MAX_TOKENS, concurrent=True)
    diff = [i for i, (g, w) in enumerate(zip(got, oracle, strict=True))
            if g.token_ids != w.token_ids]
    assert not diff, f"prompts {diff} differ from colocated"
    tcp_stack.wait_idle()  # also: no lease left on the prefill worker, no block leaked
    prefill, decode = tcp_stack.workers["prefill"], tcp_stack.workers["decode"]
    assert prefill.kv_data is not None and prefill.kv_data.port > 0
    assert decode.aengine is not None
    stats = dict(decode.aengine.kv_loader.transport_stats)  # type: ignore[union-attr]
    assert set(stats) == {"tcp"}, stats
    assert stats["tcp"].pulls >= len(prompts) // 2 and stats["tcp"].bytes > 0
