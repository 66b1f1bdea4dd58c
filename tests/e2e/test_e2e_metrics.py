"""The gateway's /metrics shows the real workers' engine metrics (real SmolLM2, real workers).

The prefill and decode workers report their engine stats in `GetLoad`; the gateway mirrors the
latest report of each worker as `{role, worker}`-labelled series (gateway/metrics.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")  # before the import below: its asserts explain

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.support.e2e_stack import HOST, MODEL_NAME, Stack  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

Series = dict[tuple[str, str, str], float]  # (sample name, role, worker) -> value
# Long enough for several full 16-token blocks, so the repeat finds cached blocks.
PROMPT = "Here is a list of calm facts about lighthouses, the sea and the keepers. " * 6


def _scrape(stack: Stack) -> Series:
    text = httpx.get(f"http://{HOST}:{stack.gateway.rest_port}/metrics", timeout=10).text
    return {(s.name, s.labels["role"], s.labels["worker"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if "worker" in s.labels and "role" in s.labels}


def _scrape_until(stack: Stack, predicate: Callable[[Series], bool], what: str) -> Series:
    """Scrape until `predicate` holds (the gateway polls the workers every 0.5 s); bounded."""
    deadline = time.monotonic() + 30
    while True:
        series = _scrape(stack)
        if predicate(series):
            return series
        if time.monotonic() > deadline:
            raise AssertionError(f"gateway /metrics never showed {what}: {series}")
        time.sleep(0.1)


def test_gateway_metrics_mirror_the_workers_engines(disagg_stack: Stack) -> None:
    url = disagg_stack.rest_url + "/completions"
    for _ in range(2):  # the second prefill finds the first one's blocks in the prefix cache
        r = httpx.post(url, timeout=120, json={"model": MODEL_NAME, "prompt": PROMPT,
                                               "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
    disagg_stack.wait_idle()
    prefill = disagg_stack.workers["prefill"]
    assert prefill.aengine is not None
    kv = prefill.aengine.engine.kv
    key = ("prefill", f"{HOST}:{prefill.port}")
    # Idle now: the engine's totals are final, and the next poll brings exactly them.
    series = _scrape_until(
        disagg_stack,
        lambda s: (s.get(("splitserve:prefix_cache_queries_total", *key)) == kv.prefix_cache_queries
                   and s.get(("splitserve:prefix_cache_hits_total", *key)) == kv.prefix_cache_hits),
        "the prefill engine's prefix-cache totals")
    assert series[("splitserve:prefix_cache_queries_total", *key)] > 0
    assert series[("splitserve:prefix_cache_hits_total", *key)] > 0
    usage = {k[1:]: v for k, v in series.items() if k[0] == "splitserve:kv_cache_usage_perc"}
    assert set(usage) == {(role, f"{HOST}:{w.port}") for role, w in disagg_stack.workers.items()}
    assert all(0.0 <= v <= 1.0 for v in usage.values()), usage
    healthy = {k[1:]: v for k, v in series.items() if k[0] == "splitserve:worker_healthy"}
    assert set(healthy.values()) == {1.0} and set(healthy) == set(usage)
    # The decode worker pulled the prompts' KV (over the prefill worker's data port, as the
    # decode log says) and its totals per way come through too, equal to the loader's own.
    decode = disagg_stack.workers["decode"]
    assert decode.aengine is not None
    loader = decode.aengine.kv_loader
    stats = dict(loader.transport_stats)  # type: ignore[union-attr]
    assert set(stats) == {"tcp"} and stats["tcp"].pulls >= 1

    def pulls_by_way() -> dict[tuple[str, str], float]:
        text = httpx.get(f"http://{HOST}:{disagg_stack.gateway.rest_port}/metrics",
                         timeout=10).text
        return {(s.name, s.labels["transport"]): s.value
                for family in text_string_to_metric_families(text) for s in family.samples
                if s.name.startswith("splitserve:kv_pull")
                and s.labels["worker"] == f"{HOST}:{decode.port}"}

    deadline = time.monotonic() + 30  # the next load poll brings the final totals
    while (pulls := pulls_by_way()).get(("splitserve:kv_pulls_total", "tcp")) != stats[
            "tcp"].pulls:
        assert time.monotonic() < deadline, pulls
        time.sleep(0.1)
    assert pulls[("splitserve:kv_pull_bytes_total", "tcp")] == stats["tcp"].bytes > 0
    # Each pulled prompt took at least one run of blocks, at most one per block.
    runs = pulls[("splitserve:kv_pull_block_runs_total", "tcp")]
    assert runs == stats["tcp"].block_runs
    assert stats["tcp"].pulls <= runs <= stats["tcp"].bytes // loader._spec.block_nbytes  # type: ignore[union-attr]
    assert 0 < pulls[("splitserve:kv_pull_seconds_total", "tcp")] < 60
