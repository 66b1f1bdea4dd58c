"""Draft-model proposer: a smaller model with the target's vocabulary drafts each request's next
tokens greedily, all of a step's requests in one batch (vLLM's `draft_model` method).

The draft has its own weights, KV cache and CUDA graphs (a `ModelRunner` on the target's
device), but no scheduler: the target's scheduler already decided which requests run. Each
request keeps its draft KV between rounds. After a verify step the draft's KV is right up to
the first rejected draft, so a round computes 1 token per request (2 when every draft was
accepted: the last draft was never fed), then k - 1 more:

    catch-up (only rows the draft has not seen but the last)   eager, or a decode graph
    the last known token       → draft 1                       decode graph
    draft j fed back           → draft j + 1   (j < k)         decode graphs, inputs on device

The drafts stay on the device from one step to the next (the runner's in-flight inputs, as
under async scheduling); the host waits once, for all k. A request's first round computes its
whole sequence (its target KV came from a prefill worker, or it was drafting-paused): eager
steps within the token budget.

A greedy request's drafts are the draft model's argmax. A randomly sampling request's drafts
are sampled from the draft's distribution filtered by the request's own temperature, top-k,
top-p and min-p, and that distribution goes to the rejection sampler as q
(`Request.spec_draft_probs`), which accepts draft x with probability min(1, p(x)/q(x)): the
target's distribution stays exact, and a draft that agrees with the target is accepted as
often as it agrees (with one-hot drafts only p(x) of the time). A seeded request's drafts
come from a generator of their own, seeded from the request's seed but not equal to it (the
acceptance draws must not repeat the drafts' draws).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoadConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.loader import load_model_source
from engine.request import Request
from engine.runner import ModelRunner, PendingStep
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.spec import draft_cap
from engine_api.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0)
# Mixed into a seeded request's seed for its drafts' generator.
_DRAFT_SEED_SALT = 0x5DEECE66D


def draft_sampling(params: SamplingParams) -> SamplingParams:
    """How the draft samples for a request with `params`: argmax for greedy requests, else the
    request's filtered distribution (penalties and stops are the target's business)."""
    if params.greedy:
        return _GREEDY
    seed = None if params.seed is None else (params.seed ^ _DRAFT_SEED_SALT) & (2**63 - 1)
    return SamplingParams(temperature=params.temperature, top_k=params.top_k,
                          top_p=params.top_p, min_p=params.min_p, seed=seed)


def draft_load_config(target: EngineConfig) -> LoadConfig:
    """The draft's weights (`SpeculativeConfig.model`) in the target's dtype."""
    return LoadConfig(model=target.speculative.model, dtype=target.load.dtype,
                      seed=target.load.seed)


def draft_runner_config(target: EngineConfig) -> EngineConfig:
    """The draft runner's settings: the target's device, dtype, block size, batch limits and
    CUDA-graph settings; its own weights and memory share."""
    spec = target.speculative
    return EngineConfig(
        load=draft_load_config(target),
        # As many blocks as the target's when it was given a number (the draft then holds as
        # many tokens), else sized from the draft's memory share as the target's would be.
        cache=CacheConfig(block_size=target.cache.block_size, enable_prefix_caching=False,
                          num_gpu_blocks=target.cache.num_gpu_blocks,
                          gpu_memory_utilization=spec.draft_gpu_memory_utilization,
                          cpu_kv_cache_bytes=target.cache.cpu_kv_cache_bytes),
        scheduler=SchedulerConfig(
            max_num_seqs=target.scheduler.max_num_seqs,
            max_num_batched_tokens=target.scheduler.max_num_batched_tokens, gc_threshold=None),
        # No piecewise graphs: the draft's steps follow the target's rounds (not measured with
        # them on the GPU).
        runner=dataclasses.replace(target.runner, quantization="none",
                                   decode_overlap_min_batch=0, piecewise_graph_max_tokens=0),
        speculative=SpeculativeConfig(),
    )


@dataclass(slots=True)
class _DraftSeq:
    """One target request's draft state: KV written for `request.all_token_ids[:fed_from]`
    and then for `fed_drafts` (the drafts fed back in the last round)."""

    target: Request
    request: Request              # the draft runner's view: all_token_ids is the target's list
    block_ids: list[int] = field(default_factory=list)
    fed_from: int = 0
    fed_drafts: list[int] = field(default_factory=list)

    def valid_prefix(self, token_ids: list[int]) -> int:
        """Positions whose draft KV holds `token_ids`' tokens."""
        n = self.fed_from
        for tok in self.fed_drafts:
            if n >= len(token_ids) or token_ids[n] != tok:
                break
            n += 1
        return n


@dataclass(slots=True)
class _Round:
    seq: _DraftSeq
    n: int        # the target's known tokens
    k: int        # drafts asked for
    start: int    # first position the draft has not computed


class DraftModelProposer:
    def __init__(self, target: EngineConfig, vocab_size: int, max_model_len: int) -> None:
        source = load_model_source(draft_load_config(target))
        cfg = source.config
        if cfg.vocab_size != vocab_size:
            raise ConfigError(
                f"the draft model's vocabulary ({cfg.vocab_size} tokens) differs from the "
                f"target's ({vocab_size}); a draft must share the target's tokenizer")
        # Sequences longer than the draft's context get no drafts.
        limit = min(cfg.max_position_embeddings, max_model_len)
        config = draft_runner_config(target)
        self.runner = ModelRunner(config, cfg, limit, source.weights, source.dummy_seed,
                                  source.default_dtype)
        self.block_size = config.cache.block_size
        num_blocks = self.runner.result.num_blocks
        self.max_model_len = min(limit, num_blocks * self.block_size)
        self.runner.max_model_len = self.max_model_len
        self.token_budget = config.scheduler.max_num_batched_tokens
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() takes block 0 first
        self.seqs: dict[str, _DraftSeq] = {}
        # Counters for benchmarks and tests: rounds, launched steps, tokens computed to catch
        # up (not counting the last known token each round feeds), and seconds in `propose_batch`.
        self.num_rounds = 0
        self.num_steps = 0
        self.num_catchup_tokens = 0
        self.num_no_room = 0  # requests left without drafts for want of draft KV blocks
        self.busy_s = 0.0
        logger.info("draft model %s: %d layers, %d KV blocks of %d tokens",
                    target.speculative.model, cfg.num_hidden_layers, num_blocks, self.block_size)

    # ---- Proposer ----------------------------------------------------------------------------

    def propose_batch(self, reqs: Sequence[Request]) -> list[list[int]]:
        start_time = time.perf_counter()
        rounds: list[_Round] = []
        index: dict[str, int] = {}
        for i, req in enumerate(reqs):
            r = self._plan(req)
            if r is not None:
                rounds.append(r)
                index[req.request_id] = i
        drafts: list[list[int]] = [[] for _ in reqs]
        if rounds:
            for rid, toks in self._run(rounds).items():
                drafts[index[rid]] = toks
            self.num_rounds += 1
        self.busy_s += time.perf_counter() - start_time
        return drafts

    def release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.free_blocks.extend(reversed(seq.block_ids))

    def shutdown(self) -> None:
        self.seqs.clear()
        self.runner.release()

    # ---- planning ----------------------------------------------------------------------------

    def _plan(self, req: Request) -> _Round | None:
        """Where `req`'s draft stands, with blocks for this round's k drafts (None: no room)."""
        tokens = req.all_token_ids
        n = len(tokens)
        # Draft j (j < k) is fed at position n - 1 + j: the last fed stays inside the context.
        k = min(draft_cap(req), self.max_model_len - n + 1)
        if k <= 0:
            return None
        seq = self.seqs.get(req.request_id)
        if seq is None or seq.target is not req:
            if seq is not None:  # a new request under a finished one's id
                self.release(req.request_id)
            seq = _DraftSeq(req, Request(req.request_id, [], draft_sampling(req.sampling_params)))
            self.seqs[req.request_id] = seq
        seq.request.all_token_ids = tokens  # read-only here; no copy
        start = min(seq.valid_prefix(tokens), n - 1)
        if not self._reserve(seq, n + k - 1):
            self.release(req.request_id)
            self.num_no_room += 1
            return None
        return _Round(seq, n, k, start)

    def _reserve(self, seq: _DraftSeq, num_positions: int) -> bool:
        need = -(-num_positions // self.block_size) - len(seq.block_ids)
        if need > len(self.free_blocks):
            self._drop_finished()
        if need > len(self.free_blocks):
            return False
        for _ in range(max(0, need)):
            seq.block_ids.append(self.free_blocks.pop())
        return True

    def _drop_finished(self) -> None:
        """Free the state of requests that ended without a `release` (a safety net)."""
        for rid in [rid for rid, s in self.seqs.items() if s.target.is_finished]:
            self.release(rid)

    # ---- the round ---------------------------------------------------------------------------

    def _run(self, rounds: list[_Round]) -> dict[str, list[int]]:
        self._catch_up([r for r in rounds if r.start < r.n - 1])
        sampled = any(not r.seq.request.sampling_params.greedy for r in rounds)
        pending: list[PendingStep] = []
        for j in range(max(r.k for r in rounds)):
            # Step j feeds the last known token (j = 0), then draft j; it samples draft j + 1.
            step = [self._sched(r.seq, r.n - 1 + j, 1, True) for r in rounds if r.k > j]
            pending.append(self._launch(step, keep_probs=sampled))
        drafts: dict[str, list[int]] = {r.seq.target.request_id: [] for r in rounds}
        for p in pending:
            for rid, tok in p.result().items():
                drafts[rid].append(tok.token_id)
        for r in rounds:
            got = drafts[r.seq.target.request_id]
            r.seq.fed_from = r.n
            r.seq.fed_drafts = got[:-1]  # the last draft was sampled, never fed
        if sampled:
            self._keep_draft_probs(rounds, pending)
        return drafts

    @staticmethod
    def _keep_draft_probs(rounds: list[_Round], pending: list[PendingStep]) -> None:
        """Hand each randomly sampling request its drafts' distributions, [k, V] on the
        device (row j of step j's probabilities)."""
        row_of = [{q.request_id: i for i, q in enumerate(p.tokens.reqs)} if p.tokens else {}
                  for p in pending]
        for r in rounds:
            if r.seq.request.sampling_params.greedy:
                continue
            rows = []
            for p, at in zip(pending[:r.k], row_of[:r.k], strict=True):
                assert p.tokens is not None and p.tokens.probs is not None
                rows.append(p.tokens.probs[at[r.seq.target.request_id]])
            r.seq.target.spec_draft_probs = torch.stack(rows)

    def _catch_up(self, behind: list[_Round]) -> None:
        """Compute each request's tokens from `start` up to its last known one (exclusive):
        one decode step when each is a single token (the usual case: all drafts accepted),
        else eager steps of at most the token budget."""
        if not behind:
            return
        self.num_catchup_tokens += sum(r.n - 1 - r.start for r in behind)
        if all(r.start == r.n - 2 for r in behind):
            # Sampled only so the step can replay a decode graph; the tokens are not used.
            self._launch([self._sched(r.seq, r.start, 1, True) for r in behind])
            return
        todo = [(r.seq, r.start, r.n - 1) for r in behind]
        while todo:
            budget = self.token_budget
            step: list[ScheduledRequest] = []
            rest: list[tuple[_DraftSeq, int, int]] = []
            for seq, pos, end in todo:
                take = min(end - pos, budget)
                if take > 0:
                    step.append(self._sched(seq, pos, take, False))
                    budget -= take
                if pos + take < end:
                    rest.append((seq, pos + take, end))
            self._launch(step)
            todo = rest

    def _sched(self, seq: _DraftSeq, pos: int, n: int, sample: bool) -> ScheduledRequest:
        return ScheduledRequest(seq.request, n, pos, seq.block_ids, sample)

    def _launch(self, step: list[ScheduledRequest], keep_probs: bool = False) -> PendingStep:
        self.num_steps += 1
        pending = self.runner.launch(SchedulerOutput(scheduled=step), keep_probs)
        return pending if pending is not None else PendingStep(None)
