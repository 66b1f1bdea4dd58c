"""Scheduler policies: token budget, decodes first, chunked prefill, the prefill role's lease and
the decode role's remote-KV path (scheduler level with made-up tokens, then end to end on a tiny
model: prefill-role KV handed to a decode-role engine reproduces colocated greedy output)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, LoadConfig, RunnerConfig, SchedulerConfig
from engine.kv.kv_cache_manager import KVCacheManager
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestStatus
from engine.scheduler import SampledToken, Scheduler, SchedulerOutput
from engine_api.request_options import RemoteKv, RequestOptions
from engine_api.sampling_params import SamplingParams
from tests.support.engine_driver import greedy

BS = 4
ROOT = b"\x02" * 32


def _sched(budget: int = 8, blocks: int = 32, role: str = "colocated", chunked: bool = True,
           lease_ms: int = 30_000, max_num_seqs: int = 8) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          enable_chunked_prefill=chunked, role=role,  # type: ignore[arg-type]
                          kv_lease_ms=lease_ms, max_model_len=64)
    return Scheduler(cfg, KVCacheManager(blocks, BS, True, ROOT), max_model_len=64)


def _req(rid: str, n: int, max_tokens: int = 8, **kw: object) -> Request:
    return Request(rid, [(i * 7 + len(rid)) % 50 for i in range(n)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_model_len=64,
                   **kw)  # type: ignore[arg-type]


def _step(s: Scheduler, token: int = 1) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, {x.request.request_id: SampledToken(token)
                               for x in out.scheduled if x.sample})
    s.check_integrity()
    return out


def test_token_budget_and_decodes_first() -> None:
    s = _sched(budget=10)
    s.add_request(_req("a", 3))
    s.add_request(_req("b", 3))
    out = _step(s)  # two whole prefills
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 3), ("b", 3)]
    s.add_request(_req("c", 40))
    for _ in range(4):
        out = _step(s)
        assert out.num_batched_tokens == sum(x.num_new_tokens for x in out.scheduled) <= 10
        kinds = [x.num_new_tokens == 1 for x in out.scheduled]
        assert kinds == sorted(kinds, reverse=True), "decodes before prefills"
    out = s.schedule()
    # a and b decode (1 token each) first; c's prefill chunk fills the rest of the budget.
    assert [x.request.request_id for x in out.scheduled][:2] == ["a", "b"]
    assert out.scheduled[-1].request.request_id == "c"
    assert out.num_batched_tokens == 10


def test_chunked_prefill_splits_a_long_prompt() -> None:
    s = _sched(budget=8)
    req = _req("long", 20)
    s.add_request(req)
    chunks = []
    while req.num_output_tokens == 0:
        out = _step(s)
        [x] = out.scheduled
        chunks.append((x.num_computed_tokens, x.num_new_tokens, x.sample))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert req.num_computed_tokens == 20 and req.output_token_ids == [1]


def test_unchunked_prefill_runs_whole() -> None:
    s = _sched(budget=8, chunked=False)
    req = _req("long", 20)
    s.add_request(req)
    [x] = _step(s).scheduled
    assert (x.num_new_tokens, x.sample) == (20, True)


def test_max_num_seqs_caps_a_step() -> None:
    s = _sched(budget=64, max_num_seqs=2)
    for i in range(4):
        s.add_request(_req(f"r{i}", 3))
    assert len(s.schedule().scheduled) == 2


def test_preemption_recomputes_and_frees() -> None:
    s = _sched(budget=64, blocks=6)  # 24 token slots
    a, b = _req("a", 8, max_tokens=12), _req("b", 8, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    preempted: list[str] = []
    for _ in range(40):
        if not s.has_work():
            break
        preempted += _step(s).preempted_ids
    assert preempted and s.num_preemptions == len(preempted)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.num_output_tokens == b.num_output_tokens == 12
    assert s.kv.num_free_blocks == 6


# ---- prefill role: lease ---------------------------------------------------------------------------

def test_prefill_role_holds_a_lease_until_release_or_expiry() -> None:
    s = _sched(budget=16, role="prefill", lease_ms=5_000)
    req = _req("p", 10)
    s.add_request(req)
    out = s.schedule()
    [(r, [tok])] = s.update_from_output(out, {"p": SampledToken(42)})
    assert r.status == RequestStatus.FINISHED_PREFILL and tok.token_id == 42
    assert r.status.finish_reason is None
    lease = s.leases["p"]
    assert lease.num_tokens == 10 and len(lease.block_ids) == 3
    assert len(lease.block_hashes) == 2  # only full blocks are hashed
    assert all(s.kv.pool.blocks[b].ref_cnt == 1 for b in lease.block_ids)
    assert s.kv.num_free_blocks == 32 - 3
    s.check_integrity()
    assert not s.has_work()
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(_req("p", 4))  # the id is taken while its lease lives
    assert s.expire_leases(now=lease.deadline - 1.0) == []
    assert s.release_lease("p") is lease
    assert s.kv.num_free_blocks == 32 and s.release_lease("p") is None
    # The released prompt blocks stay in the prefix cache.
    again = _req("p", 10)
    s.add_request(again)
    s.schedule()
    assert again.num_cached_tokens == 8

    s2 = _sched(budget=16, role="prefill", lease_ms=5_000)
    s2.add_request(_req("q", 6))
    _step(s2)
    deadline = s2.leases["q"].deadline
    assert [x.lease_id for x in s2.expire_leases(now=deadline)] == ["q"]
    assert not s2.leases and s2.kv.num_free_blocks == 32
    s2.check_integrity()


def test_prefill_role_stop_at_first_token_frees_without_lease() -> None:
    s = _sched(role="prefill")
    req = _req("p", 5, max_tokens=1)  # the first token is also the last
    s.add_request(req)
    _step(s)
    assert req.status == RequestStatus.FINISHED_LENGTH and not s.leases
    assert s.kv.num_free_blocks == 32


# ---- decode role: remote KV ------------------------------------------------------------------------

def _remote(rid: str, n: int, first: list[int]) -> Request:
    return _req(rid, n, output_token_ids=first, remote_kv=RemoteKv(n, handle=f"h-{rid}"))


def test_decode_role_remote_kv_ok() -> None:
    s = _sched(role="decode")
    req = _remote("d", 10, [7])
    s.add_request(req)
    out = s.schedule()
    assert out.is_empty
    [load] = out.kv_loads
    assert load.request is req and load.num_tokens == 10 and len(load.block_ids) == 3
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV and s.num_running == 1
    assert s.schedule().kv_loads == []  # not started twice
    s.finish_kv_load("d", ok=True)
    assert req.status == RequestStatus.RUNNING and req.num_computed_tokens == 10
    [x] = _step(s).scheduled
    assert (x.num_computed_tokens, x.num_new_tokens, x.sample) == (10, 1, True)
    assert req.output_token_ids == [7, 1]


def test_decode_role_failed_load_recomputes() -> None:
    s = _sched(budget=32, role="decode")
    req = _remote("d", 10, [7])
    s.add_request(req)
    assert len(s.schedule().kv_loads) == 1
    s.finish_kv_load("d", ok=False)
    assert req.status == RequestStatus.WAITING and req.remote_kv is None
    assert s.kv.num_free_blocks == 32  # nothing of the failed pull is kept or cached
    [x] = _step(s).scheduled
    # Prompt + the first token, recomputed: the next token is sampled after it.
    assert (x.num_computed_tokens, x.num_new_tokens, x.sample) == (0, 11, True)
    assert req.output_token_ids == [7, 1]


def test_decode_role_abort_during_load_keeps_blocks_until_reported() -> None:
    s = _sched(role="decode")
    s.add_request(_remote("d", 10, [7]))
    [load] = s.schedule().kv_loads
    s.finish_request("d", RequestStatus.FINISHED_ABORTED)
    assert s.kv.block_ids("d") == load.block_ids  # the transfer may still write there
    s.finish_kv_load("d", ok=True)
    assert not s.kv.block_ids("d") and s.kv.num_free_blocks == 32 and not s.requests
    s.check_integrity()


def test_decode_role_remote_kv_without_first_token_progresses() -> None:
    # Regression: the KV covered every known token, so nothing was left to compute and the
    # request never sampled (it sat in `running` forever).
    s = _sched(role="decode")
    req = _remote("d", 8, [])
    s.add_request(req)
    s.schedule()
    s.finish_kv_load("d", ok=True)
    [x] = _step(s).scheduled
    assert (x.num_computed_tokens, x.num_new_tokens, x.sample) == (7, 1, True)
    assert req.output_token_ids == [1]


def test_decode_role_preempted_after_load_recomputes_locally() -> None:
    # Regression: a request preempted after a completed pull started a second pull, from a
    # lease the first pull had already released (policy `fail` would then abort the request).
    s = _sched(budget=64, role="decode", blocks=6)
    a, b = _remote("a", 8, [1]), _remote("b", 8, [1])
    a.sampling_params.max_tokens = b.sampling_params.max_tokens = 12
    s.add_request(a)
    s.add_request(b)
    assert len(s.schedule().kv_loads) == 2
    s.finish_kv_load("a", ok=True)
    s.finish_kv_load("b", ok=True)
    for _ in range(40):
        if not s.has_work():
            break
        assert _step(s).kv_loads == []
    assert s.num_preemptions > 0
    assert a.num_output_tokens == b.num_output_tokens == 12


# ---- end to end on a tiny model -------------------------------------------------------------------

def _engine(path: Path, role: str, blocks: int | None = None) -> LLMEngine:
    return LLM.from_config(EngineConfig(
        load=LoadConfig(model=str(path), dtype="float32"),
        cache=CacheConfig(block_size=BS, num_gpu_blocks=blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=8, role=role),  # type: ignore[arg-type]
        runner=RunnerConfig(device="cpu"))).engine


def _run(engine: LLMEngine) -> None:
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return
        engine.step()
        engine.scheduler.check_integrity()
    raise AssertionError("engine did not finish")


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]


def _colocated(path: Path, prompt: list[int]) -> Request:
    """The colocated engine's greedy run of `prompt` (8 tokens): the reference."""
    colo = _engine(path, "colocated")
    want = colo.add_request("c", prompt, greedy(8))
    _run(colo)
    return want


@pytest.mark.parametrize("load_ok", [True, False], ids=["kv-pulled", "kv-failed"])
def test_disaggregated_equals_colocated(tiny_model_dirs: dict[str, Path], load_ok: bool) -> None:
    path = tiny_model_dirs["qwen2"]
    prompt = PROMPT
    want = _colocated(path, prompt)

    pre = _engine(path, "prefill")
    p = pre.add_request("x", prompt, greedy(8))
    _run(pre)
    assert p.status == RequestStatus.FINISHED_PREFILL and p.output_token_ids == want.output_token_ids[:1]
    lease = pre.get_lease("x")
    assert lease is not None and lease.num_tokens == len(prompt)
    kv = pre.runner.read_blocks(lease.block_ids)  # [n, layers, 2, bs, Hkv, D]

    dec = _engine(path, "decode")
    d = dec.add_request("x", prompt, greedy(8), output_token_ids=p.output_token_ids,
                        remote_kv=RemoteKv(len(prompt), handle=lease.lease_id))
    dec.step()
    [load] = dec.take_kv_loads()
    assert load.request is d and dec.take_kv_loads() == []
    if load_ok:
        dec.runner.write_blocks(load.block_ids, kv)
        assert pre.release_lease("x") and pre.kv.num_free_blocks == pre.kv.num_blocks
    else:  # whatever a failed pull left in the blocks must never be used
        dec.runner.write_blocks(load.block_ids, torch.full_like(kv, 1e4))
    dec.finish_kv_load("x", ok=load_ok)
    assert (d.num_computed_tokens == len(prompt)) == load_ok
    _run(dec)
    assert d.output_token_ids == want.output_token_ids
    assert dec.kv.num_free_blocks == dec.kv.num_blocks


def test_prefill_role_decodes_a_request_asked_to_decode_here(
        tiny_model_dirs: dict[str, Path]) -> None:
    """`RequestOptions.decode_here` (a prefill worker's Decode, with no decode worker left):
    the prefill-role engine runs the request to its end, as a colocated one does, and holds
    no lease for it; a request without it still hands off at its first token."""
    path = tiny_model_dirs["qwen2"]
    prompt = PROMPT
    want = _colocated(path, prompt)
    pre = _engine(path, "prefill")
    whole = pre.add_request("w", prompt, RequestOptions(greedy(8), decode_here=True))
    handed = pre.add_request("h", prompt, greedy(8))
    _run(pre)
    assert whole.status == RequestStatus.FINISHED_LENGTH
    assert whole.output_token_ids == want.output_token_ids
    assert handed.status == RequestStatus.FINISHED_PREFILL
    assert pre.get_lease("w") is None and pre.release_lease("h")
    assert pre.kv.num_free_blocks == pre.kv.num_blocks


# ---- async scheduling: step n+1 is scheduled before step n's tokens are known ---------------------

def _sampled(out: SchedulerOutput, token: int) -> dict[str, SampledToken]:
    return {x.request.request_id: SampledToken(token) for x in out.scheduled if x.sample}


def test_async_schedule_counts_the_token_in_flight() -> None:
    s = _sched(budget=16)
    a = _req("a", 5, max_tokens=3)
    s.add_request(a)
    first = s.schedule()  # prefill, samples token 1 (in flight)
    assert (a.num_computed_tokens, a.num_inflight) == (5, 1)
    second = s.schedule()  # before token 1 is known: decode its position, sample token 2
    [x] = second.scheduled
    assert (x.num_computed_tokens, x.num_new_tokens, x.sample) == (5, 1, True)
    assert a.num_inflight == 2 and a.num_tokens == 5
    s.update_from_output(first, _sampled(first, 11))
    assert a.output_token_ids == [11] and a.num_inflight == 1
    third = s.schedule()  # token 3 would be the last (max_tokens=3) and is scheduled
    assert [y.num_computed_tokens for y in third.scheduled] == [6]
    s.update_from_output(second, _sampled(second, 12))
    # Tokens 1-2 known, token 3 in flight: it ends the request by length, so nothing is scheduled.
    assert s.schedule().is_empty
    s.update_from_output(third, _sampled(third, 13))
    assert a.output_token_ids == [11, 12, 13] and a.is_finished and a.num_inflight == 0
    s.check_integrity()
    assert not s.kv.req_to_blocks


def test_async_stop_with_a_step_in_flight_drops_its_token() -> None:
    s = _sched(budget=16)
    a = _req("a", 4, max_tokens=8)
    a.sampling_params.ignore_eos = False
    a.eos_token_ids = (99,)
    s.add_request(a)
    first = s.schedule()
    second = s.schedule()  # launched before the EOS of `first` is known
    s.update_from_output(first, _sampled(first, 99))
    assert a.is_finished and a.output_token_ids == [99]
    assert s.update_from_output(second, _sampled(second, 5)) == []  # the extra token is dropped
    assert a.output_token_ids == [99]
    s.check_integrity()
    assert not s.kv.req_to_blocks


def test_pinned_blocks_are_neither_evicted_nor_reused_until_unpinned() -> None:
    """A tier save pins a finished request's cached blocks while it reads them off the engine
    thread: they leave the free queue (no eviction), the integrity check counts the pin, and a
    request that needs every free block cannot get them until the pin is dropped."""
    s = _sched(budget=24, blocks=6)
    req = _req("a", 9, max_tokens=1)  # 2 full blocks + 1 token
    s.add_request(req)
    while req.status != RequestStatus.FINISHED_LENGTH:
        _step(s)
    hashes = req.block_hashes[:2]
    assert s.kv.num_free_blocks == 6  # finished: its blocks are free, still cached
    pinned = s.pin_cached("pin-1", [*hashes, b"\x09" * 32])  # the last one is not cached
    assert [h for _, h in pinned] == hashes
    assert s.kv.num_free_blocks == 4
    s.check_integrity()
    with pytest.raises(ValueError, match="in use"):
        s.pin_cached("pin-1", hashes)
    big = _req("bb", 20, max_tokens=1)  # another prompt, 5 blocks: 4 are free while pinned
    s.add_request(big)
    assert s.schedule().scheduled == []
    s.unpin("pin-1")
    s.unpin("pin-1")  # twice is harmless
    assert s.kv.num_free_blocks == 6 and not s.pins
    assert [x.request.request_id for x in _step(s).scheduled] == ["bb"]
    assert s.pin_cached("pin-2", [b"\x09" * 32]) == [] and not s.pins  # nothing cached: no pin


def test_tail_load_runs_beside_the_head_and_its_blocks_outlive_an_abort() -> None:
    """RemoteKv.first_token: the head computes while the tail [8, 16) loads; a landed tail is
    jumped over; an aborted request keeps its blocks until the load ends; a running request
    whose tail is being written is never the preemption victim; a failed tail is computed."""
    s = _sched(budget=4, blocks=32)
    s.add_request(_req("t", 18, remote_kv=RemoteKv(16, handle="tail", cached=True,
                                                   first_token=8)))
    out = _step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("t", 4)]
    (load,) = out.kv_loads
    assert load.first_block == 2 and len(load.block_ids) == 2
    assert [x.num_new_tokens for x in _step(s).scheduled] == [4]  # the head's second chunk
    assert _step(s).scheduled == []  # head done, tail not landed: nothing to compute
    assert s.only_loads_pending()
    s.finish_kv_load("t", ok=True)
    out = _step(s)  # jumped to 16: the last 2 tokens computed, one sampled
    req = out.scheduled[0].request
    assert out.scheduled[0].num_new_tokens == 2 and out.scheduled[0].sample
    assert req.num_cached_tokens == 8 and req.remote_kv is None

    # Aborted while the tail is written: its blocks stay held until the load ends.
    s2 = _sched(budget=4, blocks=32)
    s2.add_request(_req("a", 18, remote_kv=RemoteKv(16, handle="tail", first_token=8)))
    _step(s2)
    free = s2.kv.num_free_blocks
    s2.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s2.kv.num_free_blocks == free and "a" in s2.kv.req_to_blocks
    s2.check_integrity()
    s2.finish_kv_load("a", ok=True)
    assert "a" not in s2.kv.req_to_blocks and "a" not in s2.tail_loads

    # Out of blocks: the newer request with a tail in flight is not the victim; a failed
    # tail is computed through.
    s3 = _sched(budget=8, blocks=6)
    s3.add_request(_req("o", 4, max_tokens=16))
    _step(s3)
    s3.add_request(_req("newer", 18, remote_kv=RemoteKv(16, handle="tail", first_token=8)))
    _step(s3)  # 4 blocks held by "newer", 1 by "o"
    for _ in range(10):
        _step(s3)  # "o" outgrows its block: preempted itself, never "newer"
    assert "newer" in s3.tail_loads and s3.requests["o"].status == RequestStatus.PREEMPTED
    s3.finish_kv_load("newer", ok=False)
    assert "newer" not in s3.tail_loads and s3.requests["newer"].remote_kv is None
    out = _step(s3)
    assert [(x.request.request_id, x.num_computed_tokens) for x in out.scheduled] == [("newer", 8)]
