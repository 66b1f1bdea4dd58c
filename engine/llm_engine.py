"""The engine: schedule → run → postprocess, one step at a time (single-threaded).

Services drive it through `engine.async_engine.AsyncEngine`, which owns the thread.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from engine.attention.kv_calibration import calibration_token_ids
from engine.attention.kv_channels import factors_digest
from engine.bad_words import bad_words_token_ids
from engine.classifier import Classifier
from engine.config import ConfigError, EngineConfig, ModelConfig, PoolerConfig
from engine.engine_setup import eos_ids, make_classifier, make_proposers, resolve_async
from engine.handoff import KvLoad, Lease
from engine.heap import freeze_startup_heap, thaw_heap, unfreeze_startup_heap
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv_access import KvAccess
from engine.lora_admin import LoRAAdmin
from engine.outputs import StepOutput
from engine.pooler import resolve_pooler
from engine.pooling import accumulate
from engine.request import PoolingState, Request, RequestStatus
from engine.request_checks import RequestChecks
from engine.runner import ModelRunner, PendingStep
from engine.sampler import depends_on_outputs
from engine.scheduler import SampledToken, Scheduler, SchedulerOutput
from engine.spec import Proposer, draft_cap, propose_all
from engine.spec.budget import StepBudget
from engine.spec.cost import StepCostModel
from engine.spec.shadow import ShadowDrafts
from engine.spec.stats import AcceptanceStats, DraftRounds
from engine.spec.suffix import SuffixProposer
from engine.step_outputs import StepOutputs
from engine.structured import GrammarCompiler, RequestGrammar, StructuredOutputError
from engine_api.errors import EngineInputError
from engine_api.hashing import model_fingerprint, root_hash
from engine_api.pooling_params import PoolingParams
from engine_api.request_options import RemoteKv, RequestOptions
from engine_api.sampling_params import SamplingParams
from engine_api.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


# An embedding request's `Request.sampling_params`: never sampled with (it finishes when its
# prompt is computed), there because every request carries some.
_POOLING_SAMPLING = SamplingParams(max_tokens=1)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model_config: ModelConfig
    max_model_len: int
    block_size: int
    num_blocks: int
    fingerprint: bytes
    device: str
    dtype: str


class LLMEngine:
    def __init__(self, config: EngineConfig, *, detokenize: bool = True) -> None:
        from engine.loader import load_model_source

        thaw_heap()  # dropped engines' device memory must be free before this one sizes its KV
        config.cache.validate()
        config.scheduler.validate()
        config.speculative.validate()
        config.runner.validate()
        config.parallel.validate()
        config.lora.validate()
        config.pooler.validate()
        self.config = config
        source = load_model_source(config.load)
        cfg = source.config
        self.model_config = cfg
        self.chat_template = source.chat_template
        self.tokenizer: Tokenizer | None = None
        tok_path = config.load.tokenizer or source.tokenizer_source
        self.tokenizer_source = tok_path  # the gateway loads the same tokenizer from here
        if tok_path:
            self.tokenizer = Tokenizer.from_file(tok_path)
        self.max_model_len = config.scheduler.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ConfigError(
                f"max_model_len ({self.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({cfg.max_position_embeddings})")
        self.eos_token_ids = eos_ids(cfg, source.generation_config, self.tokenizer)
        # The model's generation_config.json as read (sampling defaults: engine_api/generation_defaults.py).
        self.generation_config = dict(source.generation_config)
        # Embedding requests' default pooling (every field set): found here, at start-up.
        self.pooler: PoolerConfig = resolve_pooler(config.pooler, config.load.model)
        # A draft model comes first: on a GPU its memory is taken before the target's KV cache
        # is sized from what is left.
        # method → proposer; the configured method's first (requests default to it).
        self.proposers: dict[str, Proposer] = make_proposers(config, cfg, self.max_model_len)
        self.runner = ModelRunner(
            config, cfg, self.max_model_len, source.weights, source.dummy_seed,
            source.default_dtype,
            kv_calibration_ids=lambda: calibration_token_ids(self.tokenizer, cfg.vocab_size))
        quant = config.runner.quantization
        # An int8 cache's channel factors decide what its blocks mean: blocks stored under other
        # factors must never be read under these (KV handoff, prefix tiers, prefix hashes).
        factors = factors_digest(self.runner.kv_channel_factors)
        self.fingerprint = model_fingerprint(
            {**cfg.to_hf_dict(), "weights_id": cfg.weights_id,
             **({"quantization": quant} if quant != "none" else {}),
             **({"kv_channel_factors": factors} if factors is not None else {})},
            dtype=str(self.runner.dtype), kv_cache_dtype=config.cache.kv_cache_dtype,
            block_size=config.cache.block_size, parallel_layout=config.parallel.layout)
        capacity = self.runner.result.num_blocks * config.cache.block_size
        if capacity < self.max_model_len:
            # One sequence must always fit the whole cache, or it could never be scheduled.
            logger.warning("KV cache holds %d tokens; lowering max_model_len from %d to that",
                           capacity, self.max_model_len)
            self.max_model_len = capacity
            self.runner.max_model_len = capacity
        self.kv = KVCacheManager(self.runner.result.num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching,
                                 root_hash(self.fingerprint, config.cache.tenant_salt),
                                 keep_runs=config.keeps_block_runs())
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        # Speculation's measured step cost and acceptance (engine/spec/cost.py, stats.py), and
        # the per-step cap they give (budget.py); the worker reports them to the gateway.
        spec = config.speculative
        self.spec_cost = StepCostModel()
        graphs = self.runner.verify_graphs
        if graphs is not None and self.runner.verify_graph_min_fill <= 0:
            self.spec_cost.verify_pad = (self.runner.verify_q_len, graphs.buckets[-1])
        self.spec_stats = AcceptanceStats(spec.num_speculative_tokens)
        self.spec_rounds = DraftRounds()  # the worker's own drafting decisions, counted
        self.spec_budget: StepBudget | None = (
            StepBudget(self.spec_cost, self.spec_stats, spec.num_speculative_tokens)
            if self.proposers and spec.step_budget else None)
        # Drafts nobody verifies, scored against what follows: acceptance for every cheap
        # proposer on a sample of the requests (engine/spec/shadow.py).
        self.spec_shadow = ShadowDrafts(self.spec_stats)
        self._indexers = [p for p in self.proposers.values() if isinstance(p, SuffixProposer)]
        # What the services do with the KV besides requests: leases, pins, block I/O.
        self.kv_access = KvAccess(self.scheduler, self.runner)
        self.loras = LoRAAdmin(config, cfg, self.runner, self.scheduler, self.fingerprint)
        # Sequence classification / cross-encoder scoring (pooling requests get class logits).
        self.classifier: Classifier | None = make_classifier(config.pooler, cfg, self.runner.model,
                                                             self.tokenizer)
        if self.classifier is not None:
            # Classifiers pool the last position's hidden state as it is (transformers' heads).
            self.pooler = PoolerConfig(config.pooler.pooling_type or "LAST", False)
        # Structured outputs' constraints, compiled against this model's vocabulary on first use.
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, self.eos_token_ids)
        self.detokenize = detokenize and self.tokenizer is not None
        self.checks = RequestChecks(config, cfg, self.max_model_len, self.pooler, self.classifier,
                                    self.tokenizer is not None, self.loras.slot)
        # `bad_words`' tokenizer call (one object: engine/bad_words.py caches by it).
        self._encode_text = (None if self.tokenizer is None
                             else functools.partial(self.tokenizer.encode, add_special_tokens=False))
        self._outputs = StepOutputs(self.scheduler, self.tokenizer, self.detokenize,
                                   self.classifier)
        self._kv_loads: list[KvLoad] = []
        self.num_steps = 0
        self.is_shut_down = False
        self.async_scheduling = resolve_async(config, self.runner.device)
        self._inflight: tuple[SchedulerOutput, PendingStep] | None = None
        freeze_startup_heap(config.scheduler.gc_threshold)
        logger.info("engine ready: %s, %d KV blocks of %d tokens on %s (%s)", cfg.architecture,
                    self.runner.result.num_blocks, config.cache.block_size,
                    self.runner.result.device, self.runner.dtype)

    @property
    def class_labels(self) -> tuple[str, ...]:
        """The classifier's labels (what a pooling request's output holds one logit per), or ()
        for an embedding model."""
        return () if self.classifier is None else self.classifier.labels

    @property
    def proposer(self) -> Proposer | None:
        """The configured method's proposer (None: no speculative decoding)."""
        return self.proposers.get(self.config.speculative.method)

    @proposer.setter
    def proposer(self, proposer: Proposer) -> None:
        """Replace the configured method's proposer (benchmarks and tests script drafts)."""
        self.proposers[self.config.speculative.method] = proposer

    def _release_drafts(self, request_id: str) -> None:
        self.spec_shadow.release(request_id)
        for proposer in self.proposers.values():
            proposer.release(request_id)

    def shutdown(self) -> None:
        """Give back the device memory now (graphs, KV cache, weights) and unfreeze the heap
        (see `freeze_startup_heap`) so that dropping the engine frees the rest. The engine
        refuses to step after this."""
        self._inflight = None
        for proposer in self.proposers.values():
            proposer.shutdown()
        self.runner.release()
        self.is_shut_down = True
        unfreeze_startup_heap()

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.model_config, self.max_model_len, self.config.cache.block_size,
                          self.runner.result.num_blocks, self.fingerprint,
                          self.runner.result.device, str(self.runner.dtype))

    # ---- requests --------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], options: RequestOptions) -> None:
        """Every check `add_request` makes beyond `RequestOptions`' own (`RequestChecks`);
        reads config only, so any thread may call it."""
        self.checks.check_request(prompt_token_ids, options)

    def check_priority(self, priority: int) -> None:
        """`RequestChecks.check_priority`."""
        self.checks.check_priority(priority)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 num_output_tokens: int = 0) -> None:
        """`RequestChecks.validate`."""
        self.checks.validate(prompt_token_ids, params, num_output_tokens)

    def resolve_pooling(self, params: PoolingParams) -> PoolingParams:
        """`RequestChecks.resolve_pooling`."""
        return self.checks.resolve_pooling(params)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | PoolingParams | RequestOptions,
                    *, output_token_ids: list[int] | None = None, remote_kv: RemoteKv | None = None,
                    arrival_time: float | None = None,
                    num_speculative_tokens: int | None = None,
                    speculative_method: str | None = None,
                    lora_name: str | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> Request:
        """Queue a request: a generation with `SamplingParams`, or an embedding request with
        `PoolingParams` (its prompt computed and pooled, nothing sampled: engine/pooling.py).
        Raises EngineInputError / SamplingParamsError on bad input (a constraint that does not
        compile: EngineInputError).

        `params` with the keywords (what `RequestOptions` says of each) make the request's
        `RequestOptions`; or `params` is one already built, and the keywords stay unset.
        `num_speculative_tokens` never exceeds the engine's own cap; `lora_name` is one of the
        engine's adapters (`LoRAConfig.modules`); a `priority` but 0 needs the scheduling
        policy "priority" (`SchedulerConfig.policy`)."""
        options = params if isinstance(params, RequestOptions) else RequestOptions(
            params, output_token_ids=output_token_ids, remote_kv=remote_kv,
            num_speculative_tokens=num_speculative_tokens, speculative_method=speculative_method,
            lora_name=lora_name, priority=priority, cache_salt=cache_salt)
        self.check_request(prompt_token_ids, options)
        grammar = (self.make_grammar(options.params, options.output_token_ids)
                   if isinstance(options.params, SamplingParams) else None)
        return self.enqueue(request_id, prompt_token_ids, options, grammar=grammar,
                            arrival_time=arrival_time)

    def make_grammar(self, params: SamplingParams, output_token_ids: list[int] | None = None
                     ) -> RequestGrammar | None:
        """The request's grammar state when it asks for structured outputs (None otherwise),
        advanced by the tokens it already has. Compiling may take milliseconds to seconds
        (the first call also imports xgrammar): services call it off the engine thread; it is
        thread-safe. Raises EngineInputError when the constraint does not compile or the
        tokens break it."""
        spec = params.structured_outputs
        if spec is None:
            return None
        try:
            return self.grammars.grammar(spec, output_token_ids or ())
        except StructuredOutputError as e:
            raise EngineInputError(str(e)) from None

    def enqueue(self, request_id: str, prompt_token_ids: list[int], options: RequestOptions,
                *, grammar: RequestGrammar | None = None,
                arrival_time: float | None = None) -> Request:
        """Queue a request that passed `check_request` (callers validate off the engine thread,
        so the step loop does not scan the prompt twice), with its grammar from `make_grammar`
        when it asks for structured outputs."""
        params = options.params
        if isinstance(params, PoolingParams):
            return self._enqueue_pooling(request_id, prompt_token_ids, params, options,
                                         arrival_time)
        if (grammar is None) != (params.structured_outputs is None):
            raise EngineInputError("a request with structured_outputs is queued with its "
                                   "grammar (LLMEngine.make_grammar), and only such a request")
        req = Request(request_id, prompt_token_ids, params, self.eos_token_ids, self.max_model_len,
                      output_token_ids=options.output_token_ids, remote_kv=options.remote_kv,
                      arrival_time=arrival_time, priority=options.priority)
        req.grammar = grammar
        req.decode_here = options.decode_here
        if params.bad_words and self._encode_text is not None:  # (checked by check_request)
            req.bad_words_token_ids = bad_words_token_ids(params.bad_words, self._encode_text)
        self._bind_lora(req, options)
        req.num_speculative_tokens = self._speculative_tokens(req, options.num_speculative_tokens)
        req.spec_shadow_k = self._speculative_tokens(req, None)
        method = options.speculative_method
        req.spec_method = method if method in self.proposers else self.config.speculative.method
        req.spec_class = options.speculative_class
        req.spec_fixed = options.speculative_fixed
        self.scheduler.add_request(req)
        self._outputs.track(request_id, prompt_token_ids, params)
        return req

    def _enqueue_pooling(self, request_id: str, prompt_token_ids: list[int],
                         params: PoolingParams, options: RequestOptions,
                         arrival_time: float | None) -> Request:
        """Queue an embedding request: no detokenizer, no grammar, no drafts."""
        req = Request(request_id, prompt_token_ids, _POOLING_SAMPLING, self.eos_token_ids,
                      self.max_model_len, arrival_time=arrival_time, priority=options.priority)
        req.pooling = PoolingState(self.resolve_pooling(params), req.num_prompt_tokens)
        self._bind_lora(req, options)
        self.scheduler.add_request(req)
        return req

    def _bind_lora(self, req: Request, options: RequestOptions) -> None:
        """Run `req` with its adapter (`options.lora_name`; None: the base model), its KV
        hashed under the adapter's root, salted by `options.cache_salt` when it has one."""
        lora_name, cache_salt = options.lora_name, options.cache_salt
        req.lora_slot = self.lora_slot(lora_name)
        if lora_name is not None or cache_salt:
            req.hash_root = self.hash_root(lora_name, cache_salt)

    # ---- LoRA adapters (engine/lora_admin.py) ------------------------------------------------

    @property
    def runtime_lora(self) -> bool:
        """Whether adapters can be added and removed while the engine runs."""
        return self.loras.runtime

    def lora_names(self) -> list[str]:
        """The adapters loaded now, by slot."""
        return self.loras.names()

    def lora_requests(self) -> dict[str, tuple[int, int]]:
        """`LoRAAdmin.requests`: each loaded adapter's (running, waiting) requests."""
        return self.loras.requests()

    def add_lora(self, name: str, path: str) -> None:
        """`LoRAAdmin.add`: load adapter `name` from `path` into a free slot (engine thread)."""
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        """`LoRAAdmin.remove`: unload adapter `name` (engine thread)."""
        self.loras.remove(name)

    def lora_slot(self, lora_name: str | None) -> int:
        """`LoRAAdmin.slot`: the runner's slot of adapter `lora_name` (0: the base model)."""
        return self.loras.slot(lora_name)

    def hash_root(self, lora_name: str | None = None, cache_salt: str | None = None) -> bytes:
        """`LoRAAdmin.hash_root`: the root a prompt's block hashes chain from."""
        return self.loras.hash_root(lora_name, cache_salt)

    def prompt_key(self, lora_name: str | None = None, cache_salt: str | None = None) -> bytes:
        """`LoRAAdmin.prompt_key`: what a KV handle's prompt hash binds besides the tokens."""
        return self.loras.prompt_key(lora_name, cache_salt)

    def _speculative_tokens(self, req: Request, requested: int | None) -> int:
        """Drafts per step for a request: the engine's cap, lowered by the request's; none for
        sampling that reads its own output history (penalties, min_tokens), reports logprobs,
        which are defined token by token (vLLM's n-gram path has the same limits), or shapes
        the logits (a bias, an allow-list, a grammar or bad words, which the rejection sampler
        does not apply)."""
        sp = req.sampling_params
        if (not self.proposers or depends_on_outputs(req) or sp.logprobs is not None
                or sp.shapes_logits or sp.structured_outputs is not None or sp.bad_words):
            return 0
        cap = self.config.speculative.num_speculative_tokens
        return cap if requested is None else min(cap, requested)

    def abort_request(self, request_id: str) -> bool:
        self._outputs.drop(request_id)
        self._release_drafts(request_id)
        return self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED) is not None

    def calibrate_speculation(self) -> int:
        """Measure this engine's plain and verify step cost across batch sizes now, while it
        has no request (bounded; engine/spec/calibrate.py: a serving worker does it point by
        point when idle instead); returns the steps run (0: no speculation here, or
        `calibration_max_batch` 0)."""
        from engine.spec.calibrate import calibrate_step_cost

        return calibrate_step_cost(self)

    @property
    def spec_tokens(self) -> tuple[int, int]:
        """Speculative decoding so far: (drafts verified, drafts accepted)."""
        return self.scheduler.num_draft_tokens, self.scheduler.num_accepted_tokens

    @property
    def has_step_in_flight(self) -> bool:
        """A launched step's tokens have not been processed yet (async scheduling)."""
        return self._inflight is not None

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_work() or bool(self.scheduler.loading)
                or self._inflight is not None)

    # ---- disaggregation hooks --------------------------------------------------------------

    def take_kv_loads(self) -> list[KvLoad]:
        """Loads the scheduler started (remote KV: a prefill worker's or a tier's); the caller
        fills the blocks, then reports."""
        loads, self._kv_loads = self._kv_loads, []
        return loads

    def finish_kv_load(self, request_id: str, ok: bool) -> None:
        self.scheduler.finish_kv_load(request_id, ok)
        req = self.scheduler.requests.get(request_id)
        if self.proposers and req is not None:
            self._propose([req])  # its first decode step can verify drafts already

    def get_lease(self, lease_id: str) -> Lease | None:
        lease = self.scheduler.leases.get(lease_id)
        if lease is not None and lease.deadline <= time.monotonic():
            self.scheduler.release_lease(lease_id)
            return None
        return lease

    def release_lease(self, lease_id: str) -> bool:
        return self.scheduler.release_lease(lease_id) is not None

    # ---- the step --------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Schedule and launch one step; return the tokens that reached the host.

        With async scheduling the step launched here is left running and the previous one is
        finished instead (its tokens returned), so this step's scheduling, input preparation and
        launch overlap the device's work on the previous one. A request that stopped in the
        previous step (EOS, stop string) may have been scheduled once more: that extra token is
        dropped. A step whose sampling reads output history (penalties, min_tokens, a grammar)
        finishes the previous one between its forward pass and its sampling
        (`ModelRunner.launch`'s `settle`).
        """
        if self.is_shut_down:
            raise RuntimeError("the engine was shut down")
        started = time.perf_counter()
        for indexer in self._indexers:  # catch-up done between steps (a KV load's first
            indexer.take_index_seconds()  # drafts) is no part of this step's time
        self.scheduler.expire_leases()
        out = self.scheduler.schedule()
        if out.kv_loads:
            self.runner.fence_kv_loads()  # before this step: see there
        self._kv_loads.extend(out.kv_loads)
        prev, self._inflight = self._inflight, None
        waited_for = prev[0] if prev is not None else None  # (`settle` clears `prev`)
        outputs: list[StepOutput] = []

        def settle() -> None:  # the previous step's tokens to the host, its grammars advanced
            nonlocal prev
            if prev is not None:
                finished, prev = prev, None
                outputs.extend(self._finish_step(finished))

        pending = self.runner.launch(out, settle=settle)
        settle()
        if pending is not None:
            if self.async_scheduling and pending.overlappable:
                self._inflight = (out, pending)
            else:
                outputs += self._finish_step((out, pending))
        self.num_steps += 1
        if self.proposers:
            self._record_step_cost(out, waited_for, time.perf_counter() - started)
        return outputs

    def _record_step_cost(self, out: SchedulerOutput, settled: SchedulerOutput | None,
                          seconds: float) -> None:
        """Time a decode step for the cost model by its query rows. Only pure decode steps count
        (a prompt chunk would charge its compute to the rows). A call that launched a step and
        finished it times that step. A call that left its step running and finished the one
        before (async scheduling) waited for that one's device work: the time is the
        pipeline's period, the earlier step's, counted only when both are pure decode steps.
        Timed against the step launched here instead, the first decode step after a batch's
        prompts carried the prompts' compute: on the H200, 64 rows read 18.7 ms against 7.2."""
        indexing = sum(p.take_index_seconds() for p in self._indexers)
        timed = self._timed_step(out, settled)
        rows = _decode_rows(timed) if timed is not None else None
        if timed is None or rows is None:
            return
        if timed is out:
            # A step launched and finished here: the host's one-off indexing (a new request's
            # text into its suffix tree) was serial to it, and is no cost of its rows. With
            # async scheduling a plain step finished so was held back for drafts; nobody
            # drafting, plain steps overlap the next launch: that is the step "off" costs.
            if self.async_scheduling and not timed.has_drafts:
                return
            seconds -= indexing
        kv = sum(s.num_computed_tokens + s.num_new_tokens for s in timed.scheduled)
        self.spec_cost.record(rows, seconds, kv, len(timed.scheduled), timed.has_drafts)

    def _timed_step(self, out: SchedulerOutput,
                    settled: SchedulerOutput | None) -> SchedulerOutput | None:
        """The step a call's time measures (`_record_step_cost`), if any."""
        if settled is None:
            return out if self._inflight is None else None
        if self._inflight is not None and _decode_rows(out) is not None:
            return settled
        return None

    def _finish_step(self, step: tuple[SchedulerOutput, PendingStep]) -> list[StepOutput]:
        out, pending = step
        if pending.prompt is not None:  # before the tokens: a first token carries them out
            for req, lps in pending.prompt.result():
                req.prompt_logprobs.extend(lps)
        if pending.pooled is not None:  # before the update that finishes the requests
            for req, part in pending.pooled.result():
                if req.pooling is not None:
                    accumulate(req.pooling, part)
        changed = self.scheduler.update_from_output(out, pending.result())
        outputs = [self._step_output(req, toks) for req, toks in changed]
        if self.proposers:
            self._record_acceptance(out, changed)
            for req, _ in changed:
                self.spec_shadow.score(req)
            self._propose(req for req, _ in changed)
        return outputs

    def _record_acceptance(self, out: SchedulerOutput,
                           changed: list[tuple[Request, list[SampledToken]]]) -> None:
        """Each decode step of a speculating request, drafts or none, into `spec_stats` (not
        one the step budget kept at no drafts: that says nothing of the method)."""
        emitted = {req.request_id: len(toks) for req, toks in changed}
        for s in out.scheduled:
            req = s.request
            n = emitted.get(req.request_id)
            drafts = len(s.draft_token_ids)
            if (n is None or not req.num_speculative_tokens or req.spec_step_k == 0
                    or s.num_new_tokens != 1 + drafts):
                continue
            # Of at most the step's cap (the budget's this round): positions above it say
            # nothing of the method (stats.py).
            self.spec_stats.record(req.spec_method, req.spec_class, drafts, min(n - 1, drafts),
                                   allowed=draft_cap(req))

    def _propose(self, reqs: Iterable[Request]) -> None:
        """Draft the next step's tokens for the running requests that speculate and whose
        tokens are all on the host (drafts after a token still in flight would be stale); and
        the shadow proposals of the sampled ones (shadow.py: scored, not verified, so a token
        in flight does not matter)."""
        reqs = [r for r in reqs if r.status == RequestStatus.RUNNING]
        by_method: dict[str, list[Request]] = {}
        for req in reqs:
            if req.num_speculative_tokens and not req.num_inflight:
                by_method.setdefault(req.spec_method, []).append(req)
        budget = self.spec_budget
        step_k = None
        pause_floor = None
        if budget is not None:
            running = self.scheduler.running
            batch = len(running)
            kv_tokens = sum(r.num_tokens for r in running)  # what the next step's attention reads
            memo: dict[tuple[str, str], int] = {}  # this round's caps by (method, class)

            def step_k(req: Request) -> int:
                if req.spec_fixed:
                    return req.num_speculative_tokens
                return budget.cap_for(memo, req.spec_method, req.spec_class, batch,
                                      req.num_speculative_tokens, kv_tokens)

            floors: dict[int, float | None] = {}  # this round's pause floor by drafts

            def pause_floor(req: Request) -> float | None:
                k = req.spec_step_k
                if k not in floors:
                    floors[k] = budget.pause_floor(batch, k, kv_tokens)
                return floors[k]
        for method, ready in by_method.items():
            propose_all(ready, self.proposers[method],
                        self.config.speculative.min_accepted_per_step, step_k, pause_floor,
                        self.spec_rounds)
        self.spec_shadow.propose(reqs, self.proposers)

    def _step_output(self, req: Request, toks: list[SampledToken]) -> StepOutput:
        out = self._outputs.output(req, toks)  # may finish it: a stop string
        if req.is_finished:
            self._release_drafts(req.request_id)
        return out


def _decode_rows(out: SchedulerOutput) -> int | None:
    """A pure decode step's query rows (each sequence one plus its drafts, or the rows a verify
    graph padded them to), else None."""
    if not out.scheduled or out.kv_loads or any(
            s.num_new_tokens != 1 + len(s.draft_token_ids) for s in out.scheduled):
        return None
    return max(out.padded_rows, sum(s.num_new_tokens for s in out.scheduled))
