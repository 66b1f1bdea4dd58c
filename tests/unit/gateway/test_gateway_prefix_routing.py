"""Prefix-aware routing: the gateway's block hashes are the engine's, and the router prefers the
worker holding the longest prefix unless that costs too much load balance."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

import grpc

from engine.kv.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine_api.hashing import model_fingerprint, root_hash
from engine_api.sampling_params import SamplingParams
from gateway.prefix_index import PrefixIndex, prompt_block_hashes
from gateway.router import Worker, WorkerPool
from protos.splitserve.v1 import common_pb2

FP = model_fingerprint({"arch": "test"}, dtype="float32", kv_cache_dtype="auto", block_size=4)


def test_gateway_hashes_equal_engine_hashes() -> None:
    ids = list(range(1, 23))  # 5 full blocks of 4, 2 tokens left over
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True, root=root_hash(FP))
    req = Request("r", ids, SamplingParams(max_tokens=1))
    engine_hashes = kv.update_hashes(req)
    assert len(engine_hashes) == 5
    assert prompt_block_hashes(ids, FP, 4) == engine_hashes
    other = model_fingerprint({"arch": "other"}, dtype="float32", kv_cache_dtype="auto",
                              block_size=4)
    assert prompt_block_hashes(ids, other, 4)[0] != engine_hashes[0]


def test_prefix_index_matches_leading_blocks_and_evicts_lru() -> None:
    index = PrefixIndex(max_hashes_per_worker=3)
    hs = prompt_block_hashes(list(range(40)), FP, 4)
    index.record("a", hs[:3])
    assert index.match("a", hs) == 3
    other = prompt_block_hashes([7, *range(1, 40)], FP, 4)  # differs in the first token
    assert index.match("a", other) == 0  # chained hashes: a different start shares no block
    index.record("a", hs[3:4])            # evicts hs[0], the least recently used
    assert index.match("a", hs) == 0
    assert index.match("b", hs) == 0


def _two_healthy(role: Literal["prefill", "decode"]) -> tuple[WorkerPool, Worker, Worker]:
    """A pool of two workers marked healthy (no poll: the tests set their load reports)."""
    pool = WorkerPool(role, ["127.0.0.1:1", "127.0.0.1:2"])
    for w in pool.workers:
        w.healthy = True
    return pool, pool.workers[0], pool.workers[1]


async def test_router_prefers_prefix_then_load() -> None:
    pool, a, b = _two_healthy("prefill")
    try:
        for w in pool.workers:
            w.load = common_pb2.LoadReport(block_size=4, fingerprint=FP)
        ids = list(range(100, 140))
        hashes = pool.prompt_hashes(ids)
        assert hashes == prompt_block_hashes(ids, FP, 4)
        memo: dict[tuple[bytes, int], list[bytes]] = {}
        assert pool.prompt_hashes(ids, memo) == hashes and memo == {(FP, 4): hashes}
        assert pool.prompt_hashes(ids, memo) is memo[(FP, 4)]  # hashed once per layout
        pool.prefix_index.record(b.address, hashes[:6])
        a.load = common_pb2.LoadReport(block_size=4, fingerprint=FP, num_running=1)
        b.load = common_pb2.LoadReport(block_size=4, fingerprint=FP, num_running=3)
        assert pool.pick_for_prefix(hashes).address == b.address  # busier, but holds the prefix
        b.load = common_pb2.LoadReport(block_size=4, fingerprint=FP, num_running=1 + 10)
        assert pool.pick_for_prefix(hashes).address == a.address  # too busy: least loaded wins
        pool.mark_failed(b.address)
        assert pool.prefix_index.match(b.address, hashes) == 0
    finally:
        await pool.close()


async def test_a_burst_sharing_a_new_prefix_follows_the_first_pick() -> None:
    """Nothing is cached yet and no prefill has answered: the first request of a burst goes to
    the least-loaded worker, the rest of the burst that shares its prefix follow it (each pick
    counts as pending load) until `max_imbalance` spills one; another prompt goes by load."""
    pool, a, b = _two_healthy("prefill")
    try:
        a.load = common_pb2.LoadReport(block_size=4, fingerprint=FP, num_running=2)
        b.load = common_pb2.LoadReport(block_size=4, fingerprint=FP, num_running=0)
        shared = list(range(100, 132))  # 8 blocks, then each request's own tokens
        burst = [pool.prompt_hashes([*shared, 1000 + i, 2000 + i, 3000 + i, 4000 + i])
                 for i in range(8)]
        picks = [pool.pick_for_prefix(h).address for h in burst]
        # b: 0 pending; each pick adds one; b may run max_imbalance (4) ahead of a's 2
        assert picks[:7] == [b.address] * 7
        assert picks[7] == a.address  # b is 7 pending against a's 2: spilled
        assert pool.prefix_index.match(b.address, burst[0]) == len(burst[0])
        other = pool.prompt_hashes(list(range(500, 540)))
        assert pool.pick_for_prefix(other).address == a.address  # a: 3 pending, b: 7
    finally:
        await pool.close()


async def test_a_load_report_from_a_finished_burst_is_corrected_by_the_ends_seen_since() -> None:
    pool, a, b = _two_healthy("decode")
    try:
        a.apply_report(common_pb2.LoadReport(num_running=1))  # another gateway's request
        b.apply_report(common_pb2.LoadReport(num_running=9))  # others' too
        burst = [pool.pick() for _ in range(5)]
        assert [w.address for w in burst] == [a.address] * 5
        a.apply_report(common_pb2.LoadReport(num_running=6))  # polled while ours ran there
        b.apply_report(common_pb2.LoadReport(num_running=0))
        for w in burst:  # they end before the next poll
            pool.done(w)
        assert (a.routing_key()[0], b.routing_key()[0]) == (1, 0)
        assert pool.pick().address == b.address
        pool.done(b)
        pool.done(b)  # one end too many (a caller's mistake) does not make load negative
        assert (a.routing_key()[0], b.routing_key()[0]) == (1, 0)
    finally:
        await pool.close()


async def test_a_request_on_its_way_when_polled_still_counts_after_another_ends() -> None:
    """The report misses a request still travelling to the worker; it is this gateway's, so
    it counts until its own call ends (the estimate of 2382c9e lost it when another ended)."""
    pool, a, b = _two_healthy("decode")
    try:
        a.apply_report(common_pb2.LoadReport(num_running=3))
        b.apply_report(common_pb2.LoadReport())
        first, second = pool.pick(), pool.pick()
        assert first is second is b
        b.apply_report(common_pb2.LoadReport(num_running=1))  # the second not there yet
        assert b.routing_key()[0] == 2
        pool.done(b)  # the first ends
        assert b.routing_key()[0] == 1
        pool.done(b)
        assert b.routing_key()[0] == 0
    finally:
        await pool.close()


def test_gateway_sends_requests_sharing_a_prefix_to_one_decode_worker() -> None:
    """Colocated (the decode workers compute prompts): requests that share a prefix go to the
    worker that got the first of them, not round-robin over equally loaded workers."""
    from protos.splitserve.v1 import gateway_pb2, gateway_pb2_grpc
    from tests.support.gateway_fakes import Harness, Script

    with Harness(Script([1, 2, 3]), colocated=True, num_decode=2) as h:
        for w in h.decode:
            w.report = common_pb2.LoadReport(block_size=4, fingerprint=FP)
        time.sleep(0.5)  # a load poll: the pool learns the block layout
        with grpc.insecure_channel(h.grpc_target) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            for prefix in (list(range(10, 42)), list(range(100, 132))):
                for own in range(3):
                    req = gateway_pb2.GenerateRequest(
                        token_ids=gateway_pb2.TokenIds(ids=[*prefix, 200 + own]),
                        sampling=common_pb2.SamplingParams(max_tokens=2))
                    list(stub.Generate(req, timeout=20))
        by_prefix: dict[int, set[str]] = {}
        for w in h.decode:
            for r in w.decode_requests:
                by_prefix.setdefault(r.prompt_token_ids[0], set()).add(w.address)
        assert sorted(by_prefix) == [10, 100]
        assert all(len(workers) == 1 for workers in by_prefix.values()), by_prefix


def test_gateway_prefix_routing_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import gateway.router, gateway.prefix_index, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[3], check=True)
    assert out.stdout.strip() == "False"


async def test_adapter_requests_route_by_the_adapters_own_prefix(
        tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A worker reports each LoRA adapter's hash root; the gateway chains an adapter prompt's
    hashes from it — the engine's own hashes of that prompt under the adapter, never the base
    model's — and sends the adapter's requests to the worker holding that prefix, among the
    workers serving the adapter."""
    from engine.async_engine import AsyncEngine
    from engine.config import LoadConfig
    from engine.loader import load_model_source
    from engine.lora.adapter import ATTENTION_TARGETS
    from tests.support.engine_driver import greedy, tiny_llm
    from tools.gpu.gpu_lora_check import write_adapter
    from worker.common import EngineBound

    path = tiny_model_dirs["llama"]
    cfg = load_model_source(LoadConfig(model=str(path))).config
    write_adapter(tmp_path / "ad", cfg, ATTENTION_TARGETS, 4, 8, seed=1)
    llm = tiny_llm(path, lora_modules={"ad": str(tmp_path / "ad")})
    eng = llm.engine
    ids = list(range(3, 30))  # 6 full blocks of 4
    req = eng.add_request("r", ids, greedy(1), lora_name="ad")
    engine_hashes = eng.kv.update_hashes(req)
    base = eng.add_request("b", ids, greedy(1))
    assert eng.kv.update_hashes(base)[0] != engine_hashes[0]
    servicer = EngineBound()
    servicer.bind(AsyncEngine(eng))  # not started: the report reads its engine only
    report = servicer.load_report("prefill")
    assert list(report.lora_adapters) == ["ad"] and bytes(report.lora_roots[0]) == eng.hash_root("ad")

    pool = WorkerPool("prefill", ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    try:
        _, b, c = pool.workers
        for w in pool.workers:
            w.healthy = True
            w.load = common_pb2.LoadReport()
            w.load.CopyFrom(report)
        c.load.ClearField("lora_adapters")  # serves the base model only
        c.load.ClearField("lora_roots")
        hashes = pool.prompt_hashes(ids, lora_name="ad")
        assert hashes == engine_hashes
        assert pool.prompt_hashes(ids) == prompt_block_hashes(ids, eng.fingerprint, 4) != hashes
        pool.prefix_index.record(c.address, pool.prompt_hashes(ids))  # the base model's KV
        pool.prefix_index.record(b.address, hashes)
        b.load.num_running = 2
        for _ in range(3):
            picked = pool.pick_for_prefix(hashes, lora_name="ad")
            assert picked.address == b.address  # busier, but holds the adapter's prefix
            pool.done(picked)
    finally:
        await pool.close()
        llm.shutdown()
