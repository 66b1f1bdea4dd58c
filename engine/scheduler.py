"""Continuous batching with chunked prefill, prefix caching, preemption by recompute, and the
three roles (colocated, prefill-only, decode-only) as policies over one mechanism.

Each step: running requests first (decodes and unfinished prefill chunks, oldest first), then
waiting requests while the token budget, the sequence limit and free blocks allow. When blocks
run out, the newest running request is preempted (its blocks freed; it recomputes later).
Under the priority policy (engine/request_queue.py) "oldest" and "newest" are by priority, then
arrival, and a waiting request that finds no seat or no blocks first preempts running requests
of a less urgent priority.

A request whose remote KV covers only a tail of its prefix (`RemoteKv.first_token` > 0: the
tiers' cost model split it) runs while that KV loads: the engine computes the head (up to
`first_token`) in chunks as usual, the loader fills the tail's blocks meanwhile, and once both
are done the request jumps past the tail and computes the rest. It is never preempted (nor its
blocks freed on abort) while the load writes into its blocks.
Not thread-safe: called from the engine thread only.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.handoff import KvLoad, Lease
from engine.kv.kv_cache_manager import KVCacheManager
from engine.logprobs import TokenLogprob
from engine.request import Request, RequestStatus
from engine.request_queue import WaitingQueue, insert_running
from engine.spec import record_verify


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int         # tokens computed in this step
    num_computed_tokens: int    # tokens whose KV existed before this step
    block_ids: list[int]        # all of the request's blocks, in order
    sample: bool                # this step reaches the last known token: sample the next one
    # Speculative decoding: tokens drafted after the last known one, verified in this step
    # (num_new_tokens counts them; the rejected ones are rolled back when the step returns).
    draft_token_ids: Sequence[int] = ()


def first_rows(scheduled: Sequence[ScheduledRequest]) -> Iterator[tuple[ScheduledRequest, int]]:
    """Each scheduled request with the step's row of its first new token, as
    `ModelRunner.prepare` lays a step out (each request's new tokens in order)."""
    row = 0
    for s in scheduled:
        yield s, row
        row += s.num_new_tokens


@dataclass(slots=True)
class SchedulerOutput:
    # Decodes first, then prefill chunks; the runner lays tokens out in this order.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    kv_loads: list[KvLoad] = field(default_factory=list)       # to start this step
    preempted_ids: list[str] = field(default_factory=list)
    # A scheduled request still has prompt tokens to score (engine/prompt_logprobs.py): only
    # then does the runner look for their rows (not on every decode step).
    scores_prompt: bool = False
    # A scheduled request is an embedding request (engine/pooling.py): the runner pools its rows.
    pools: bool = False
    # Set by the runner when it computed more rows than the step's tokens: a verify graph's
    # rows, each sequence padded to the graph's rows per sequence (the step cost's rows).
    padded_rows: int = 0

    @property
    def is_pure_decode(self) -> bool:
        return all(s.num_new_tokens == 1 for s in self.scheduled)

    @property
    def has_drafts(self) -> bool:
        return any(s.draft_token_ids for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class TailLoad:
    """A running request's KV of prompt tokens [start, end) being loaded (see the module
    docstring); `landed`: the load finished, the jump waits for the head's compute."""

    request: Request
    start: int
    end: int
    landed: bool = False


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None
    # Speculative decoding: the tokens the same step emitted after this one (accepted drafts,
    # then the target's own token); token_id is the first of them.
    more: Sequence[int] = ()


class Scheduler:
    """Owns the request queues and the KV cache manager."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.max_model_len = max_model_len
        # Without chunking a prompt must fit one step.
        self.token_budget = (config.max_num_batched_tokens if config.enable_chunked_prefill
                             else max(config.max_num_batched_tokens, max_model_len))
        self.policy = config.policy
        self.waiting = WaitingQueue(config.policy)
        # Scheduled first to last; the last is the next to preempt (request_queue.py).
        self.running: list[Request] = []
        self._admissions = itertools.count()
        self.loading: dict[str, Request] = {}
        # Running requests whose prefix's tail loads while their head computes, by id.
        self.tail_loads: dict[str, TailLoad] = {}
        self.requests: dict[str, Request] = {}
        self.leases: dict[str, Lease] = {}
        # Cached blocks held by readers off the engine thread (tier saves), by pin id.
        self.pins: set[str] = set()
        self.num_preemptions = 0
        self.num_draft_tokens = 0      # speculative decoding: drafts verified
        self.num_accepted_tokens = 0   # ... and accepted

    # ---- queue changes ---------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests or req.request_id in self.leases:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.priority and self.policy != "priority":
            raise ValueError(f"request {req.request_id!r} has priority {req.priority}, but the "
                             "scheduling policy is not 'priority'")
        req.queue_seq = next(self._admissions)
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Abort or stop a request from outside (cancellation, stop string). Frees its blocks."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            # A transfer is writing into its blocks: keep them until finish_kv_load frees them,
            # or they could be handed to another request and overwritten.
            req.status = status
            return req
        tail = self.tail_loads.get(request_id)
        if tail is not None and not tail.landed:  # the same, while its head computes
            if req in self.running:
                self.running.remove(req)
            req.status = status
            return req
        self.tail_loads.pop(request_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self._free(req)
        return req

    def pin_cached(self, pin_id: str, hashes: Sequence[bytes]) -> list[tuple[int, bytes]]:
        """Hold the prefix cache's blocks of `hashes` (those it has) under `pin_id`, so they
        are neither evicted nor handed to another request while something reads them off the
        engine thread: a full, hashed block is never written again while it is held. Returns
        (block id, hash) of the held blocks; `unpin(pin_id)` lets them go."""
        if pin_id in self.pins or pin_id in self.kv.req_to_blocks or pin_id in self.requests:
            raise ValueError(f"pin id {pin_id!r} is in use")
        found = [(b, h) for h in hashes if (b := self.kv.pool.get_cached_block(h)) is not None]
        if not found:
            return []
        self.kv.hold(pin_id, [b for b, _ in found])
        self.pins.add(pin_id)
        return [(b.block_id, h) for b, h in found]

    def unpin(self, pin_id: str) -> None:
        if pin_id in self.pins:
            self.pins.discard(pin_id)
            self.kv.free_by_id(pin_id)

    def finish_kv_load(self, request_id: str, ok: bool) -> None:
        """Decode role: the KV pull for `request_id` ended. On failure the prompt is recomputed
        (a tail load's: the head's compute goes on through the tail)."""
        tail = self.tail_loads.get(request_id)
        if tail is not None:
            tail_req = tail.request
            if tail_req.status.finished:  # aborted while the load ran: its blocks are free now
                del self.tail_loads[request_id]
                self._free(tail_req)
            elif ok:
                tail.landed = True  # the next schedule jumps once the head is computed
            else:
                del self.tail_loads[request_id]
                tail_req.remote_kv = None
            return
        req = self.loading.pop(request_id, None)
        if req is None:
            return
        if req.status.finished:  # aborted while the transfer ran
            self._free(req)
            return
        assert req.remote_kv is not None
        if ok:
            # Sampling needs the last known token computed here: if the remote KV covers every
            # token (no first token was passed along), recompute the last one.
            req.num_computed_tokens = min(req.remote_kv.num_tokens, req.num_tokens - 1)
            req.num_cached_tokens = (req.num_computed_tokens if req.remote_kv.cached
                                     else max(req.num_cached_tokens, 0))
            # The KV is local now: a later preemption recomputes here instead of pulling again
            # from a lease that the completed pull has already released.
            req.remote_kv = None
            self.kv.cache_computed(req, req.num_computed_tokens)
            req.status = RequestStatus.RUNNING
            insert_running(self.running, req, self.policy)
        else:
            self.kv.free(req)
            req.remote_kv = None
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.requeue(req)

    def release_lease(self, lease_id: str) -> Lease | None:
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            self.kv.free_by_id(lease_id)
        return lease

    def expire_leases(self, now: float | None = None) -> list[Lease]:
        now = time.monotonic() if now is None else now
        expired = [lease for lease in self.leases.values() if lease.deadline <= now]
        for lease in expired:
            self.release_lease(lease.lease_id)
        return expired

    # ---- scheduling ------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def only_loads_pending(self) -> bool:
        """Nothing can be computed before a KV load lands (the engine may wait, not spin)."""
        if self.waiting:
            return False
        for req in self.running:
            tail = self.tail_loads.get(req.request_id)
            if tail is None or tail.landed or req.num_computed_tokens < tail.start:
                return False
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        scheduled: list[ScheduledRequest] = []
        preempted = False
        if self.policy == "priority":
            self._make_room_for_priority(out)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            tail = self.tail_loads.get(req.request_id)
            if tail is not None and tail.landed and req.num_computed_tokens == tail.start:
                self._land_tail(req, tail)
                tail = None
            num_new = min(req.num_tokens + req.num_inflight - req.num_computed_tokens, budget)
            if tail is not None:  # the head only, until the tail has landed
                num_new = min(num_new, tail.start - req.num_computed_tokens)
            if num_new <= 0 or (req.num_inflight and req.num_output_tokens + req.num_inflight
                                >= req.max_output_tokens()):
                i += 1  # nothing to compute, or the token in flight ends it by length
                continue
            if req.spec_token_ids:
                drafts = self._take_drafts(req, num_new, budget)
                if drafts and self.kv.allocate_slots(req, 1 + len(drafts)) is not None:
                    scheduled.append(self._scheduled(req, 1 + len(drafts), drafts))
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self._pop_victim(i)  # newest first
                if victim is None:
                    break
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append(self._scheduled(req, num_new))
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: everything after it already was too

        while self.waiting and budget > 0 and not preempted and (
                len(self.running) + len(self.loading) < self.config.max_num_seqs):
            req = self.waiting.peek()
            if req.num_inflight:
                break  # preempted with a token in flight: re-admit once the token has landed
            if req.remote_kv is not None:
                used = self._start_tail_load(req, out, budget, scheduled)
                if used is None:
                    break
                if used > 0:
                    budget -= used
                    continue
                if not self._start_kv_load(req, out):
                    break
                continue
            # A prompt still to be scored (prompt logprobs) or pooled position by position
            # (MEAN, CLS embeddings) is computed from its first token.
            hits, num_hit_tokens = (([], 0) if req.computes_whole_prompt
                                    else self.kv.get_computed_blocks(req))
            num_new = req.num_tokens - num_hit_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break
            self._admit(req, num_hit_tokens)
            scheduled.append(self._scheduled(req, num_new))
            budget -= num_new

        now = time.perf_counter()
        for s in scheduled:
            if s.request.metrics.first_scheduled_time is None:
                s.request.metrics.first_scheduled_time = now
            if s.request.scores_prompt:
                out.scores_prompt = True
            if s.request.pooling is not None:
                out.pools = True
        # Decodes first (CUDA-graph friendly layout), then prefill chunks; stable otherwise.
        out.scheduled = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        out.num_batched_tokens = self.token_budget - budget
        return out

    def _make_room_for_priority(self, out: SchedulerOutput) -> None:
        """Preempt running requests of a less urgent priority than the waiting queue's head
        while the head finds no seat (`max_num_seqs`) or too few free blocks for its first
        chunk. Before anything is scheduled, so nothing already placed in this step moves.
        Only a strictly lower priority value makes room: equals wait their turn."""
        if not self.waiting:
            return
        head = self.waiting.peek()
        if head.num_inflight:
            return  # admitted only once its token has landed: nothing to make room for yet
        n = (head.remote_kv.num_tokens if head.remote_kv is not None
             else min(head.num_tokens, self.token_budget))
        blocks = -(-n // self.block_size)  # (prefix-cache hits not counted: a bound)
        while self.running and self.running[-1].priority > head.priority and (
                len(self.running) + len(self.loading) >= self.config.max_num_seqs
                or self.kv.num_free_blocks < blocks):
            victim = self._pop_victim(len(self.running) - 1)
            if victim is None:
                return
            self._preempt(victim, out)

    def _take_drafts(self, req: Request, num_new: int, budget: int) -> list[int]:
        """The proposed drafts this step can verify for `req` (consumed either way: a proposal
        is for the step right after the token it follows)."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        if num_new != 1 or req.num_inflight:
            return []  # not at its last known token: the drafts follow a token not yet here
        # Every emitted token counts against max_tokens and the context: the target's own
        # token follows the accepted drafts.
        room = min(budget, req.max_output_tokens() - req.num_output_tokens) - 1
        return drafts[:max(0, room)]

    def _scheduled(self, req: Request, num_new: int,
                   drafts: Sequence[int] = ()) -> ScheduledRequest:
        """The step's entry for `req`; counts its new tokens as computed from now on (the step
        will write their KV before anything reads it) and a sampled token as in flight."""
        s = ScheduledRequest(
            request=req,
            num_new_tokens=num_new,
            num_computed_tokens=req.num_computed_tokens,
            block_ids=self.kv.block_ids(req.request_id),
            # An embedding request samples nothing: its prompt's end finishes it.
            sample=(req.num_computed_tokens + num_new - len(drafts)
                    == req.num_tokens + req.num_inflight and req.pooling is None),
            draft_token_ids=drafts,
        )
        req.num_computed_tokens += num_new
        if s.sample:
            req.num_inflight += 1
        return s

    def _start_kv_load(self, req: Request, out: SchedulerOutput) -> bool:
        assert req.remote_kv is not None
        n = req.remote_kv.num_tokens
        # Blocks this engine already caches need no transfer: pull only the rest. The last full
        # block is always pulled: its chained hash, checked on arrival, proves the lease holds
        # this prompt's tokens up to it (a partial block carries no hash of its own).
        hits, num_hit_tokens = self.kv.get_computed_blocks(req)
        hits = hits[: max(0, n // self.block_size - 1)]
        num_hit_tokens = len(hits) * self.block_size
        if self.kv.allocate_slots(req, n - num_hit_tokens, hits, cache=False) is None:
            return False
        self.waiting.pop()
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit_tokens
        ids = self.kv.block_ids(req.request_id)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[req.request_id] = req
        out.kv_loads.append(KvLoad(req, list(ids[len(hits):]), n, first_block=len(hits)))
        return True

    def _start_tail_load(self, req: Request, out: SchedulerOutput, budget: int,
                         scheduled: list[ScheduledRequest]) -> int | None:
        """Admit `req`, whose remote KV is a tail of its prefix, with that KV loading and the
        head's first chunk scheduled (module docstring); returns the chunk's tokens, None when
        there are too few free blocks, 0 when the KV is not such a tail or the prefix cache
        already holds the head (then it is a plain load)."""
        remote = req.remote_kv
        assert remote is not None
        start, end, bs = remote.first_token, remote.num_tokens, self.block_size
        if start <= 0 or start % bs or end - start < bs:
            return 0
        hits, num_hit_tokens = self.kv.get_computed_blocks(req)
        if num_hit_tokens >= start:
            return 0
        # Every block up to the tail's end now; the head's register in the prefix cache as
        # their chunks are scheduled, the tail's when it lands.
        if self.kv.allocate_slots(req, end - num_hit_tokens, hits, cache=False) is None:
            return None
        self._admit(req, num_hit_tokens)
        self.tail_loads[req.request_id] = TailLoad(req, start, end)
        ids = self.kv.block_ids(req.request_id)
        out.kv_loads.append(KvLoad(req, list(ids[start // bs:end // bs]), end,
                                   first_block=start // bs))
        num_new = min(start - num_hit_tokens, budget)
        self.kv.allocate_slots(req, num_new)  # no new block: registers the chunk's full ones
        scheduled.append(self._scheduled(req, num_new))
        return num_new

    def _admit(self, req: Request, num_hit_tokens: int) -> None:
        """The waiting queue's head runs from its prefix-cache hits on."""
        self.waiting.pop()
        req.num_computed_tokens = num_hit_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit_tokens
        req.status = RequestStatus.RUNNING
        insert_running(self.running, req, self.policy)

    def _land_tail(self, req: Request, tail: TailLoad) -> None:
        """The head is computed and the tail loaded: the request goes on after the tail."""
        del self.tail_loads[req.request_id]
        assert req.remote_kv is not None
        req.num_computed_tokens = min(tail.end, req.num_tokens - 1)  # see finish_kv_load
        if req.remote_kv.cached:
            req.num_cached_tokens = max(req.num_cached_tokens, 0) + tail.end - tail.start
        req.remote_kv = None
        self.kv.cache_computed(req, req.num_computed_tokens)

    def _pop_victim(self, first: int) -> Request | None:
        """Take the newest running request at index `first` or later that may be preempted
        (not one whose tail KV is still being written into its blocks); None if none."""
        for index in range(len(self.running) - 1, first - 1, -1):
            req = self.running[index]
            tail = self.tail_loads.get(req.request_id)
            if tail is None or tail.landed:
                if tail is not None:  # its loaded KV goes with its blocks: loaded again later
                    del self.tail_loads[req.request_id]
                return self.running.pop(index)
        return None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.requeue(req)
        out.preempted_ids.append(req.request_id)

    # ---- after the forward pass ------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, SampledToken]
                           ) -> list[tuple[Request, list[SampledToken]]]:
        """Append sampled tokens, finish requests (computed counts advanced at schedule time).
        Returns the requests that produced tokens in this step, with the tokens appended (one,
        or with speculative decoding up to the drafts + 1, fewer when a stop condition came
        first), and the embedding requests whose prompt it completed (no tokens: their pooled
        rows reached the host before this call). With async scheduling this runs after the next
        step was already scheduled."""
        now = time.perf_counter()
        changed: list[tuple[Request, list[SampledToken]]] = []
        for s in out.scheduled:
            req = s.request
            if req.status.finished:
                continue  # aborted (or stopped by a string) while the step ran
            if req.pooling is not None:
                if s.num_computed_tokens + s.num_new_tokens == req.num_prompt_tokens:
                    self._end(req, RequestStatus.FINISHED_POOLED)
                    changed.append((req, []))
                continue
            tok = sampled.get(req.request_id)
            if tok is None:
                continue
            # A request preempted by a later schedule() (async scheduling) keeps this token: it
            # was computed from the right context, and the recompute will include it.
            req.num_inflight -= 1
            if s.draft_token_ids:
                self._account_drafts(req, s, tok)
            appended = [tok]
            status = self._append(req, tok, now)
            for token_id in tok.more:
                if status is not None:
                    break
                appended.append(SampledToken(token_id))
                status = self._append(req, appended[-1], now)
            if status is None and self.config.role == "prefill" and not req.decode_here:
                status = RequestStatus.FINISHED_PREFILL
            if status is not None:
                self._end(req, status)
            changed.append((req, appended))
        return changed

    def _end(self, req: Request, status: RequestStatus) -> None:
        """Finish a request the step just completed: running, or preempted since the step was
        launched (async scheduling), so waiting."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self._free(req)

    def _append(self, req: Request, tok: SampledToken, now: float) -> RequestStatus | None:
        req.append_output_token(tok.token_id)
        if tok.logprob is not None:
            req.logprobs.append(tok.logprob)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.token_times.append(now)
        return req.check_stop()

    def _account_drafts(self, req: Request, s: ScheduledRequest, tok: SampledToken) -> None:
        """The step computed KV for every draft; only the accepted ones are the sequence's now.
        The rejected drafts' slots lie past its end and the next step overwrites them (spec
        steps finish before the next is scheduled, so nothing has moved the count since)."""
        num_drafts = len(s.draft_token_ids)
        num_accepted = len(tok.more)  # the emitted tokens are the accepted drafts + 1
        req.num_computed_tokens -= num_drafts - num_accepted
        record_verify(req, num_drafts, num_accepted)
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted

    def _free(self, req: Request) -> None:
        req.metrics.finished_time = time.perf_counter()
        self.requests.pop(req.request_id, None)
        if req.status == RequestStatus.FINISHED_PREFILL:
            hashes = self.kv.update_hashes(req)
            num_prompt_blocks = -(-req.num_prompt_tokens // self.block_size)
            lease_id = req.request_id
            block_ids = self.kv.transfer_to_lease(req.request_id, lease_id)
            self.leases[lease_id] = Lease(
                lease_id=lease_id,
                block_ids=block_ids[:num_prompt_blocks],
                block_hashes=hashes[: req.num_prompt_tokens // self.block_size],
                num_tokens=req.num_prompt_tokens,
                deadline=time.monotonic() + self.config.kv_lease_ms / 1000.0,
            )
        else:
            self.kv.free(req)

    # ---- stats -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.loading)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        holders = set(self.kv.req_to_blocks)
        live = ({r.request_id for r in self.running} | set(self.loading) | set(self.leases)
                | set(self.tail_loads) | self.pins)
        if not holders <= live:
            raise AssertionError(f"blocks held by unknown requests: {sorted(holders - live)}")
