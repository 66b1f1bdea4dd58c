"""Property tests of the KV bookkeeping (no model): random allocate / decode growth / free /
preempt / abort / prefix-hit sequences on KVCacheManager, and random schedule / update / abort /
KV-load / lease sequences on the Scheduler with made-up sampled tokens.

Both machines keep a *shadow KV cache* (slot -> token id written there): a step "writes" the
tokens it computes into their slots, and every read (a scheduled request's whole context, a
prefix hit, a lease) must find its own tokens. That proves more than ref counts: no block is
handed to a second writer while held, and the prefix cache never serves another prefix's KV.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.config import SchedulerConfig
from engine.dma_copy import block_runs
from engine.kv.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler import SampledToken, Scheduler, SchedulerOutput
from engine_api.request_options import RemoteKv
from engine_api.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 10
ROOT = b"\x01" * 32
# A 3-letter alphabet makes shared prefixes (prefix-cache hits) frequent.
TOKENS = st.integers(min_value=0, max_value=2)
PROMPTS = st.lists(TOKENS, min_size=1, max_size=14)
GARBAGE = -1

SETTINGS = settings(max_examples=50, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _slot(block_ids: list[int], pos: int) -> int:
    return block_ids[pos // BS] * BS + pos % BS


def _snapshot(kv: KVCacheManager) -> tuple[Any, ...]:
    """Everything allocate may mutate (not the hit statistics)."""
    pool = kv.pool
    return ([(b.ref_cnt, b.block_hash) for b in pool.blocks],
            [b.block_id for b in pool.free_queue],
            {h: b.block_id for h, b in pool.cached.items()},
            {r: [b.block_id for b in bl] for r, bl in kv.req_to_blocks.items()},
            dict(kv._num_cached_blocks))


def _check_shared_blocks_are_cached(kv: KVCacheManager) -> None:
    # Two holders may share a block only through the prefix cache (a full, hashed block).
    for b in kv.pool.blocks:
        if b.ref_cnt > 1:
            assert b.block_hash is not None, f"block {b.block_id} shared but not cached"


class ShadowKv:
    """slot -> token id last written there."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}

    def write(self, block_ids: list[int], tokens: list[int], start: int, end: int) -> None:
        for p in range(start, end):
            self.slots[_slot(block_ids, p)] = tokens[p]

    def check(self, block_ids: list[int], tokens: list[int], end: int, who: str) -> None:
        got = [self.slots.get(_slot(block_ids, p)) for p in range(end)]
        assert got == tokens[:end], f"{who}: KV of positions [0, {end}) is {got}, not {tokens[:end]}"


# ---- KVCacheManager ------------------------------------------------------------------------------

class KVManagerMachine(RuleBasedStateMachine):
    """Drives the manager the way the scheduler does, with prefill computed in one go."""

    KEEP_RUNS = False

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True, root=ROOT,
                                 keep_runs=self.KEEP_RUNS)
        self._check_turns()
        self.shadow = ShadowKv()
        self.live: dict[str, Request] = {}
        self.parked: list[Request] = []  # preempted or refused: hold no blocks
        self.ids = itertools.count()
        self.num_hit_tokens = 0

    def _admit(self, req: Request) -> None:
        hits, n_hit = self.kv.get_computed_blocks(req)
        assert n_hit < req.num_tokens and n_hit % BS == 0
        hit_ids = [b.block_id for b in hits]
        self.shadow.check(hit_ids, req.all_token_ids, n_hit, f"prefix hit of {req.request_id}")
        before = _snapshot(self.kv)
        new = self.kv.allocate_slots(req, req.num_tokens - n_hit, hits)
        if new is None:
            assert _snapshot(self.kv) == before, "a refused allocate mutated the manager"
            assert self.kv.num_free_blocks < -(-req.num_tokens // BS) - len(hits) + sum(
                1 for b in hits if b.ref_cnt == 0)
            self.parked.append(req)
            return
        blocks = self.kv.block_ids(req.request_id)
        assert blocks[:len(hits)] == hit_ids
        self.shadow.write(blocks, req.all_token_ids, n_hit, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        self.num_hit_tokens += n_hit
        self.live[req.request_id] = req

    def _pick(self, i: int) -> Request:
        return list(self.live.values())[i % len(self.live)]

    def _check_turns(self) -> None:
        """Watch every `get_new_blocks`: with LRU it hands out the `n` least recently freed
        blocks; keeping runs, those or any of the older free blocks, never a younger block
        out of its turn."""
        pool = self.kv.pool
        get_new_blocks = pool.get_new_blocks

        def checked(n: int) -> list[Any]:
            queue = [b.block_id for b in pool.free_queue]
            allowed = set(queue[:n]) | {b.block_id for b in pool.free_queue if b.old}
            new = get_new_blocks(n)
            ids = {b.block_id for b in new}
            assert len(new) == n and ids <= allowed, f"handed out {sorted(ids - allowed)} out of turn"
            if not self.KEEP_RUNS:
                assert ids == set(queue[:n])
            return new
        pool.get_new_blocks = checked  # type: ignore[method-assign]

    @rule(prompt=PROMPTS)
    def admit(self, prompt: list[int]) -> None:
        self._admit(Request(f"r{next(self.ids)}", prompt, SamplingParams()))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), token=TOKENS)
    def decode(self, i: int, token: int) -> None:
        req = self._pick(i)
        req.append_output_token(token)
        before = _snapshot(self.kv)
        if self.kv.allocate_slots(req, 1) is None:
            assert _snapshot(self.kv) == before, "a refused allocate mutated the manager"
            assert self.kv.num_free_blocks == 0
            self._preempt(req)
            return
        blocks = self.kv.block_ids(req.request_id)
        self.shadow.write(blocks, req.all_token_ids, req.num_tokens - 1, req.num_tokens)
        req.num_computed_tokens += 1

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        del self.live[req.request_id]
        self.parked.append(req)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def preempt(self, i: int) -> None:
        self._preempt(self._pick(i))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        req = self._pick(i)
        self.kv.free(req)
        del self.live[req.request_id]

    @precondition(lambda self: self.parked)
    @rule()
    def resume(self) -> None:
        self._admit(self.parked.pop(0))

    @precondition(lambda self: self.parked)
    @rule()
    def abort_parked(self) -> None:
        self.kv.free(self.parked.pop())  # holds nothing: must be a no-op

    @rule(extra=st.integers(1, 3))
    def oversized_allocate_is_refused(self, extra: int) -> None:
        req = Request(f"big{next(self.ids)}", [0] * ((self.kv.num_free_blocks + extra) * BS),
                      SamplingParams())
        before = _snapshot(self.kv)
        assert self.kv.allocate_slots(req, req.num_tokens) is None
        assert _snapshot(self.kv) == before

    @invariant()
    def consistent(self) -> None:
        self.kv.check_integrity()
        _check_shared_blocks_are_cached(self.kv)
        assert set(self.kv.req_to_blocks) == set(self.live)
        for req in self.live.values():
            blocks = self.kv.block_ids(req.request_id)
            assert len(blocks) == -(-req.num_computed_tokens // BS)
            self.shadow.check(blocks, req.all_token_ids, req.num_computed_tokens, req.request_id)

    def teardown(self) -> None:
        for req in list(self.live.values()):
            self.kv.free(req)
        self.kv.check_integrity()
        assert self.kv.num_free_blocks == NUM_BLOCKS, "blocks leaked"


TestKVManager = KVManagerMachine.TestCase
TestKVManager.settings = SETTINGS


class RunKeepingKVManagerMachine(KVManagerMachine):
    """The same traffic over `RunKeepingBlockPool` (the prefill and decode roles' pool)."""

    KEEP_RUNS = True


TestRunKeepingKVManager = RunKeepingKVManagerMachine.TestCase
TestRunKeepingKVManager.settings = SETTINGS


def test_prefix_cached_blocks_are_reused() -> None:
    kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True, root=ROOT)
    a = Request("a", list(range(13)), SamplingParams())
    assert kv.allocate_slots(a, 13) is not None
    a_blocks = kv.block_ids("a")
    kv.free(a)
    b = Request("b", [*range(12), 99, 98], SamplingParams())
    hits, n = kv.get_computed_blocks(b)
    assert n == 12 and [h.block_id for h in hits] == a_blocks[:3]
    assert kv.allocate_slots(b, 2, hits) is not None
    assert kv.block_ids("b")[:3] == a_blocks[:3]
    # The whole prompt cached: the last token is still computed (leaves one to sample from).
    c = Request("c", list(range(12)), SamplingParams())
    assert kv.get_computed_blocks(c)[1] == 8
    kv.free(b)
    assert kv.num_free_blocks == NUM_BLOCKS
    kv.check_integrity()


@pytest.mark.parametrize("caching", [False, True])
def test_new_blocks_come_in_ascending_order(caching: bool) -> None:
    """A freed request's blocks return reversed; handed out again they are ascending, so a
    prompt's positions take consecutive blocks: one KV handoff copy per run (dma_copy)."""
    kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=caching, root=ROOT)
    a, b = Request("a", [0] * 8, SamplingParams()), Request("b", [1] * 12, SamplingParams())
    assert kv.allocate_slots(a, 8) is not None and kv.allocate_slots(b, 12) is not None
    assert kv.block_ids("b") == [2, 3, 4]
    kv.free(b)
    assert [blk.block_id for blk in kv.pool.free_queue] == [5, 6, 7, 8, 9, 4, 3, 2]
    c = Request("c", [2] * 32, SamplingParams())
    assert kv.allocate_slots(c, 32) is not None
    assert kv.block_ids("c") == list(range(2, 10))  # the 8 least recently used, ascending
    assert block_runs(kv.block_ids("c"), list(range(100, 108))) == [(2, 100, 8)]
    kv.check_integrity()


@given(prompts=st.lists(PROMPTS, min_size=1, max_size=6))
@settings(max_examples=40, deadline=None)
def test_allocate_none_without_mutation_when_full(prompts: list[list[int]]) -> None:
    kv = KVCacheManager(3, BS, enable_prefix_caching=True, root=ROOT)
    for i, p in enumerate(prompts):
        req = Request(str(i), p, SamplingParams())
        hits, n = kv.get_computed_blocks(req)
        before = _snapshot(kv)
        if kv.allocate_slots(req, req.num_tokens - n, hits) is None:
            assert _snapshot(kv) == before
        kv.check_integrity()


# ---- Scheduler ------------------------------------------------------------------------------------

class SchedulerMachine(RuleBasedStateMachine):
    """Random traffic through the real Scheduler; the 'runner' only writes the shadow KV."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = itertools.count()
        self.shadow = ShadowKv()
        self.pending_loads: list[tuple[str, list[int], int, int]] = []
        self.lease_tokens: dict[str, list[int]] = {}
        self.sched: Scheduler

    @initialize(role=st.sampled_from(["colocated", "prefill", "decode"]),
                chunked=st.booleans(), budget=st.integers(2, 24), caching=st.booleans())
    def setup(self, role: str, chunked: bool, budget: int, caching: bool) -> None:
        cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                              enable_chunked_prefill=chunked, role=role,  # type: ignore[arg-type]
                              max_model_len=32)
        # The pool the engine gives each role (EngineConfig.keeps_block_runs).
        self.kv = KVCacheManager(NUM_BLOCKS, BS, caching, ROOT, keep_runs=role != "colocated")
        self.sched = Scheduler(cfg, self.kv, max_model_len=32)
        self.role = role

    @rule(prompt=PROMPTS, max_tokens=st.integers(1, 8), remote=st.booleans(),
          first=st.none() | TOKENS)
    def add(self, prompt: list[int], max_tokens: int, remote: bool, first: int | None) -> None:
        # prompt + outputs <= 22 tokens <= NUM_BLOCKS * BS: any single request fits the cache.
        rid = f"r{next(self.ids)}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if self.role == "decode" and remote:
            # The first token normally comes from the prefill worker; without it the decode
            # worker must still make progress (recompute the last prompt token).
            req = Request(rid, prompt, params, max_model_len=32,
                          output_token_ids=[] if first is None else [first],
                          remote_kv=RemoteKv(len(prompt), handle=rid))
        else:
            req = Request(rid, prompt, params, max_model_len=32)
        self.sched.add_request(req)

    @rule(tokens=st.lists(TOKENS, min_size=8, max_size=8))
    def step(self, tokens: list[int]) -> None:
        out = self.sched.schedule()
        self._check_output(out)
        for load in out.kv_loads:
            self.pending_loads.append((load.request.request_id, load.block_ids, load.num_tokens,
                                       load.first_block))
        for s in out.scheduled:
            self.shadow.write(s.block_ids, s.request.all_token_ids, s.num_computed_tokens,
                              s.num_computed_tokens + s.num_new_tokens)
        for s in out.scheduled:  # reads after all writes, as attention does per layer
            self.shadow.check(s.block_ids, s.request.all_token_ids,
                              s.num_computed_tokens + s.num_new_tokens, s.request.request_id)
        sampled = {s.request.request_id: SampledToken(tokens[i % len(tokens)])
                   for i, s in enumerate(out.scheduled) if s.sample}
        for req, _ in self.sched.update_from_output(out, sampled):
            if req.status == RequestStatus.FINISHED_PREFILL:
                self.lease_tokens[req.request_id] = req.prompt_token_ids
        return None

    def _check_output(self, out: SchedulerOutput) -> None:
        sched = self.sched
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= sched.token_budget
        assert len(out.scheduled) <= sched.config.max_num_seqs
        kinds = [s.num_new_tokens == 1 for s in out.scheduled]
        assert kinds == sorted(kinds, reverse=True), "decodes must come first"
        assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
        for s in out.scheduled:
            assert s.num_new_tokens >= 1
            end = s.num_computed_tokens + s.num_new_tokens
            assert end <= s.request.num_tokens
            assert len(s.block_ids) * BS >= end
            assert s.sample == (end == s.request.num_tokens)
            if not sched.config.enable_chunked_prefill and s.num_computed_tokens == 0:
                assert end == s.request.num_tokens, "unchunked prefill was split"

    @precondition(lambda self: self.pending_loads)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def finish_load(self, i: int, ok: bool) -> None:
        rid, block_ids, n, first = self.pending_loads.pop(i % len(self.pending_loads))
        req = self.sched.loading[rid]  # held (even if aborted) until the load is reported
        table = list(self.kv.block_ids(rid))
        # Blocks before `first` came from the local prefix cache; the load fills the rest.
        assert table[first:first + len(block_ids)] == block_ids
        assert first * BS <= n
        aborted = req.status.finished
        # The transport fills its blocks; a failed pull may leave anything there.
        self.shadow.write(table, req.prompt_token_ids if ok else [GARBAGE] * n, first * BS, n)
        self.sched.finish_kv_load(rid, ok)
        assert rid not in self.sched.loading
        if aborted:
            assert not self.kv.block_ids(rid) and rid not in self.sched.requests
        elif ok:
            assert req.status == RequestStatus.RUNNING
            assert req.num_computed_tokens == min(n, req.num_tokens - 1)
            assert req.remote_kv is None  # local from now on: preemption recomputes here
        else:
            assert req.status == RequestStatus.WAITING and req.num_computed_tokens == 0
            assert req.remote_kv is None and not self.kv.block_ids(rid)

    @precondition(lambda self: any(not r.is_finished for r in self.sched.requests.values()))
    @rule(i=st.integers(0, 100))
    def abort(self, i: int) -> None:
        rids = sorted(r for r, req in self.sched.requests.items() if not req.is_finished)
        rid = rids[i % len(rids)]
        loading = rid in self.sched.loading
        req = self.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        assert req is not None and req.status == RequestStatus.FINISHED_ABORTED
        # A request whose KV is being pulled keeps its blocks until the pull is reported.
        assert bool(self.kv.block_ids(rid)) == loading
        assert req not in self.sched.running and req not in self.sched.waiting

    @precondition(lambda self: self.sched.leases)
    @rule(i=st.integers(0, 100), expire=st.booleans())
    def end_lease(self, i: int, expire: bool) -> None:
        lids = sorted(self.sched.leases)
        lid = lids[i % len(lids)]
        if expire:
            deadline = self.sched.leases[lid].deadline
            assert lid in {lease.lease_id for lease in self.sched.expire_leases(now=deadline)}
        else:
            assert self.sched.release_lease(lid) is not None
        assert lid not in self.sched.leases and not self.kv.block_ids(lid)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        sched.check_integrity()
        _check_shared_blocks_are_cached(self.kv)
        for req in sched.waiting:
            assert not self.kv.block_ids(req.request_id), f"waiting {req} holds blocks"
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        for req in sched.running:
            assert req.status == RequestStatus.RUNNING
            blocks = self.kv.block_ids(req.request_id)
            assert len(blocks) * BS >= req.num_computed_tokens
            self.shadow.check(blocks, req.all_token_ids, req.num_computed_tokens, str(req))
        for lid, lease in sched.leases.items():
            assert lease.block_ids == self.kv.block_ids(lid)[:len(lease.block_ids)]
            assert len(lease.block_ids) == -(-lease.num_tokens // BS)
            self.shadow.check(lease.block_ids, self.lease_tokens[lid], lease.num_tokens,
                              f"lease {lid}")

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        # Drain: everything finishes (no livelock), then every block is free (no leak). Leases
        # end as decode workers acknowledge them (or expire): without that, prefill-role
        # admission waits for their blocks by design.
        for _ in range(300):
            while self.pending_loads:
                self.finish_load(0, True)
            for lid in list(sched.leases):
                sched.release_lease(lid)
            if not (sched.has_work() or sched.loading):
                break
            self.step([0, 1, 2, 0, 1, 2, 0, 1])
            self.consistent()
        assert not sched.requests, f"requests never finished: {sched.requests}"
        assert not sched.leases
        sched.check_integrity()
        assert self.kv.num_free_blocks == NUM_BLOCKS, "blocks leaked"


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = SETTINGS


@pytest.mark.parametrize("caching", [True, False])
def test_scheduler_aborts_free_everything(caching: bool) -> None:
    kv = KVCacheManager(NUM_BLOCKS, BS, caching, ROOT)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=6), kv, max_model_len=32)
    for i in range(5):
        sched.add_request(Request(str(i), [i % 2] * (5 + i), SamplingParams(max_tokens=8),
                                  max_model_len=32))
    for _ in range(4):
        out = sched.schedule()
        sched.update_from_output(out, {s.request.request_id: SampledToken(1)
                                       for s in out.scheduled if s.sample})
    for rid in list(sched.requests):
        sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert kv.num_free_blocks == NUM_BLOCKS
    assert not sched.has_work()


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=70),
       block_size=st.sampled_from([1, 4, 16]), reuse=st.integers(0, 20))
def test_block_hashes_are_the_chained_block_hash(tokens: list[int], block_size: int,
                                                 reuse: int) -> None:
    """The packed fast path equals the definition (`block_hash` chained from the root), also
    when it extends an existing prefix of hashes."""
    from engine_api.hashing import block_hash, compute_block_hashes

    root = bytes(range(32))
    want, parent = [], root
    for i in range(len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        want.append(parent)
    assert compute_block_hashes(root, tokens, block_size) == want
    prefix = want[:min(reuse, len(want))]
    assert compute_block_hashes(root, tokens, block_size, prefix) == want
    assert compute_block_hashes(root, tuple(tokens), block_size) == want
