"""The engine: schedule → run → postprocess, one step at a time (single-threaded).

Services drive it through `engine.async_engine.AsyncEngine`, which owns the thread.
"""

from __future__ import annotations

import atexit
import collections
import functools
import gc
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from engine.attention.kv_calibration import calibration_token_ids
from engine.bad_words import bad_words_token_ids
from engine.classifier import Classifier, head_classifier, token_classifier
from engine.config import (
    MAX_SPECULATIVE_TOKENS,
    SPEC_METHODS,
    ConfigError,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    PoolerConfig,
)
from engine.draft_model import DraftModelProposer
from engine.kv.kv_cache_manager import KVCacheManager
from engine.lora import LoRAAdapter, LoRAError, LoRAStack, load_adapter
from engine.outputs import StepOutput
from engine.pooler import resolve_pooler
from engine.pooling import accumulate, embedding
from engine.request import PoolingState, RemoteKv, Request, RequestStatus
from engine.runner import ModelRunner, PendingStep
from engine.sampler import depends_on_outputs
from engine.scheduler import KvLoad, Lease, SampledToken, Scheduler, SchedulerOutput
from engine.spec import Proposer, propose_all
from engine.spec.ngram import NgramProposer
from engine.structured import GrammarCompiler, RequestGrammar, StructuredOutputError
from engine_api.detokenizer import IncrementalDetokenizer
from engine_api.hashing import cache_salt_problem, model_fingerprint, root_hash, salted_root
from engine_api.pooling_params import PoolingParams, PoolingParamsError
from engine_api.sampling_params import SamplingParams
from engine_api.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineInputError(ValueError):
    """A request the engine cannot serve; the message names the field and the limit."""


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


def thaw_heap() -> None:
    """Give frozen objects back to the garbage collector and collect.

    Frees the reference cycles of engines dropped since the last freeze, and with them the
    device memory they hold (a frozen cycle is never collected). Runs before an engine sizes its
    KV cache from the free device memory."""
    gc.unfreeze()
    gc.collect()


def freeze_startup_heap(gc_threshold: tuple[int, int, int] | None = None) -> None:
    """Move every object alive now out of the garbage collector's reach, and set `gc_threshold`
    (`SchedulerConfig.gc_threshold`; None leaves the thresholds as they are).

    What an engine builds at start (module and parameter wrappers, one object per KV block,
    captured graphs) lives as long as the engine, but each full collection walked all of it:
    on an H200 host with 56k KV blocks, 12 full collections paused one offline run for 2.5 s
    (~0.2 s each), 3.7 s of 116 s with the younger generations
    (bench/results/h200/probe_tput_bf16_c2dcc73.json -> gc; 1.8 s after the freeze,
    probe_tput_bf16_796b7d4.json). vLLM freezes its startup heap the same way. The next
    engine's start (`thaw_heap`) or `LLMEngine.shutdown` gives it back. At exit the heap is
    unfrozen too, so the interpreter's last collection finalises it (extension modules such as
    Triton's report frozen objects as leaks otherwise).
    """
    global _unfreeze_at_exit
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    gc.collect()
    gc.freeze()
    if gc_threshold is not None:
        gc.set_threshold(*gc_threshold)


_unfreeze_at_exit = False


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
        self.eos_token_ids = self._eos_ids(source.generation_config)
        # The model's generation_config.json as read (sampling defaults: engine_api/generation_defaults.py).
        self.generation_config = dict(source.generation_config)
        # Embedding requests' default pooling (every field set): found here, at start-up.
        self.pooler: PoolerConfig = resolve_pooler(config.pooler, config.load.model)
        # A draft model comes first: on a GPU its memory is taken before the target's KV cache
        # is sized from what is left.
        # method → proposer; the configured method's first (requests default to it).
        self.proposers: dict[str, Proposer] = self._make_proposers(config, cfg)
        self.runner = ModelRunner(
            config, cfg, self.max_model_len, source.weights, source.dummy_seed,
            source.default_dtype,
            kv_calibration_ids=lambda: calibration_token_ids(self.tokenizer, cfg.vocab_size))
        quant = config.runner.quantization
        self.fingerprint = model_fingerprint(
            {**cfg.to_hf_dict(), "weights_id": cfg.weights_id,
             **({"quantization": quant} if quant != "none" else {})},
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
        # Each adapter's KV differs from the base model's for the same tokens: its prompts'
        # block hashes chain from a root of their own (the adapter's name and files), by name.
        self._lora_roots: dict[str, bytes] = {}
        if self.runner.lora is not None:
            for adapter in self.runner.lora.adapters:
                self._lora_roots[adapter.name] = self._lora_root(adapter)
        # Sequence classification / cross-encoder scoring (pooling requests get class logits).
        self.classifier: Classifier | None = self._make_classifier(config.pooler, cfg)
        if self.classifier is not None:
            # Classifiers pool the last position's hidden state as it is (transformers' heads).
            self.pooler = PoolerConfig(config.pooler.pooling_type or "LAST", False)
        # Structured outputs' constraints, compiled against this model's vocabulary on first use.
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, self.eos_token_ids)
        self.detokenize = detokenize and self.tokenizer is not None
        # `bad_words`' tokenizer call (one object: engine/bad_words.py caches by it).
        self._encode_text = (None if self.tokenizer is None
                             else functools.partial(self.tokenizer.encode, add_special_tokens=False))
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._kv_loads: list[KvLoad] = []
        self.num_steps = 0
        self.is_shut_down = False
        self.async_scheduling = self._resolve_async(config)
        self._inflight: tuple[SchedulerOutput, PendingStep] | None = None
        freeze_startup_heap(config.scheduler.gc_threshold)
        logger.info("engine ready: %s, %d KV blocks of %d tokens on %s (%s)", cfg.architecture,
                    self.runner.result.num_blocks, config.cache.block_size,
                    self.runner.result.device, self.runner.dtype)

    def _make_classifier(self, pooler: PoolerConfig, cfg: ModelConfig) -> Classifier | None:
        """The checkpoint's classification head, or the LM head's rows for
        `pooler.classifier_from_token` (engine/classifier.py); None for neither."""
        tokens = pooler.classifier_from_token
        model = self.runner.model
        if cfg.is_classifier:
            if tokens:
                raise ConfigError("classifier_from_token: this checkpoint has its own "
                                  f"classification head ({cfg.architecture} with labels)")
            return head_classifier(cfg, model.score.weight)  # type: ignore[union-attr]
        if not tokens:
            return None
        if self.tokenizer is None:
            raise ConfigError("classifier_from_token needs the model's tokenizer")
        ids = []
        for token in tokens:
            found = self.tokenizer.encode(token, add_special_tokens=False)
            if len(found) != 1:
                raise ConfigError(f"classifier_from_token: {token!r} is {len(found)} tokens "
                                  f"({found[:8]}), not one")
            ids.append(found[0])
        return token_classifier(cfg, model.lm_head_weight, ids, tokens)

    @property
    def class_labels(self) -> tuple[str, ...]:
        """The classifier's labels (what a pooling request's output holds one logit per), or ()
        for an embedding model."""
        return () if self.classifier is None else self.classifier.labels

    def _make_proposers(self, config: EngineConfig, cfg: ModelConfig) -> dict[str, Proposer]:
        """The configured method's proposer; beside a draft model also n-gram lookup, which
        costs nothing to hold, so the gateway can choose per request (cheaper drafts at a load
        where the draft model's steps no longer pay)."""
        spec = config.speculative
        if not spec.enabled or config.scheduler.role == "prefill":
            return {}
        ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        if spec.method == "ngram":
            return {"ngram": ngram}
        return {"draft_model": DraftModelProposer(config, cfg.vocab_size, self.max_model_len),
                "ngram": ngram}

    @property
    def proposer(self) -> Proposer | None:
        """The configured method's proposer (None: no speculative decoding)."""
        return self.proposers.get(self.config.speculative.method)

    @proposer.setter
    def proposer(self, proposer: Proposer) -> None:
        """Replace the configured method's proposer (benchmarks and tests script drafts)."""
        self.proposers[self.config.speculative.method] = proposer

    def _release_drafts(self, request_id: str) -> None:
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
        gc.unfreeze()

    def _resolve_async(self, config: EngineConfig) -> bool:
        """Async scheduling pays where the device runs apart from the host (CUDA); the prefill
        role hands each request off after one token, so there is nothing to overlap there."""
        wanted = config.scheduler.async_scheduling
        if config.scheduler.role == "prefill":
            return False
        return self.runner.device.type == "cuda" if wanted is None else wanted

    def _eos_ids(self, generation_config: dict[str, object]) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        gen = generation_config.get("eos_token_id")
        if isinstance(gen, int):
            ids.add(gen)
        elif isinstance(gen, list):
            ids.update(int(x) for x in gen)
        if self.tokenizer is not None:
            ids.update(self.tokenizer.eos_token_ids)
        return tuple(sorted(ids))

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.model_config, self.max_model_len, self.config.cache.block_size,
                          self.runner.result.num_blocks, self.fingerprint,
                          self.runner.result.device, str(self.runner.dtype))

    # ---- requests --------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 num_output_tokens: int = 0) -> None:
        self._check_token_ids(prompt_token_ids)
        vocab = self.model_config.vocab_size
        beyond = params.token_ids_beyond(vocab)
        if beyond:
            raise EngineInputError(f"logit_bias / allowed_token_ids / structured_outputs' "
                                   f"reasoning tokens name token ids outside [0, {vocab}): "
                                   f"{beyond[:5]}")
        n = len(prompt_token_ids) + num_output_tokens
        if n >= self.max_model_len:
            raise EngineInputError(
                f"prompt has {n} tokens; max_model_len is {self.max_model_len}, which must leave "
                "room for at least one generated token")

    def _check_token_ids(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise EngineInputError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if type(t) is not int or not 0 <= t < vocab]
        if bad:
            raise EngineInputError(f"prompt_token_ids contains ids outside [0, {vocab}): {bad[:5]}")

    def _check_pooling(self, prompt_token_ids: list[int], params: PoolingParams,
                       output_token_ids: list[int] | None, remote_kv: RemoteKv | None) -> None:
        """`check_request`'s checks of an embedding request."""
        if output_token_ids or remote_kv is not None:
            raise EngineInputError("an embedding request computes its prompt here and generates "
                                   "nothing: it takes no output tokens and no remote KV")
        self._check_token_ids(prompt_token_ids)
        if len(prompt_token_ids) > self.max_model_len:
            raise EngineInputError(f"prompt has {len(prompt_token_ids)} tokens; max_model_len "
                                   f"is {self.max_model_len}")
        self.resolve_pooling(params)

    def resolve_pooling(self, params: PoolingParams) -> PoolingParams:
        """`params` with the engine's defaults filled in (`PoolingParams.resolved`);
        EngineInputError for `dimensions` beyond the model's hidden size."""
        if self.classifier is not None and (params.normalize or params.dimensions is not None):
            raise EngineInputError("this model classifies: a pooling request's output is its "
                                   f"{len(self.classifier.labels)} class logit(s), to which "
                                   "normalize and dimensions do not apply")
        try:
            return params.resolved(self.pooler, self.model_config.hidden_size)
        except PoolingParamsError as e:
            raise EngineInputError(str(e)) from None

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | PoolingParams,
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

        `lora_name`: one of the engine's LoRA adapters (`LoRAConfig.modules`) to run it with;
        None: the base model.

        `num_speculative_tokens` caps this request's drafts per step (0: no speculation; None:
        the engine's `SpeculativeConfig`); it never exceeds the engine's own cap.
        `speculative_method` ("ngram" / "draft_model") picks the proposer among the engine's;
        None, or a method the engine lacks: its configured one.
        `priority`: lower is scheduled sooner; anything but 0 needs the engine's scheduling
        policy "priority" (`SchedulerConfig.policy`). `cache_salt` (vLLM's): its KV is hashed
        under a root of its own (`salted_root`), so only requests with the same salt share it."""
        self.check_request(prompt_token_ids, params, output_token_ids, remote_kv,
                           num_speculative_tokens, speculative_method, lora_name, priority,
                           cache_salt)
        grammar = (self.make_grammar(params, output_token_ids)
                   if isinstance(params, SamplingParams) else None)
        return self.enqueue(request_id, prompt_token_ids, params, output_token_ids=output_token_ids,
                            remote_kv=remote_kv, arrival_time=arrival_time,
                            num_speculative_tokens=num_speculative_tokens,
                            speculative_method=speculative_method, grammar=grammar,
                            lora_name=lora_name, priority=priority, cache_salt=cache_salt)

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

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                      output_token_ids: list[int] | None = None,
                      remote_kv: RemoteKv | None = None,
                      num_speculative_tokens: int | None = None,
                      speculative_method: str | None = None,
                      lora_name: str | None = None, priority: int = 0,
                      cache_salt: str | None = None) -> None:
        """Every check `add_request` makes; reads config only, so any thread may call it."""
        self.lora_slot(lora_name)
        self.check_priority(priority)
        check_cache_salt(cache_salt)
        if isinstance(params, PoolingParams):
            self._check_pooling(prompt_token_ids, params, output_token_ids, remote_kv)
            return
        if self.model_config.is_classifier:
            raise EngineInputError(f"this model ({self.model_config.architecture} with "
                                   f"{len(self.model_config.class_labels)} labels) classifies and "
                                   "has no LM head: it serves classification, score and "
                                   "pooling requests, not generation")
        if speculative_method is not None and speculative_method not in SPEC_METHODS[1:]:
            raise EngineInputError("speculative_method must be 'ngram' or 'draft_model', got "
                                   f"{speculative_method!r}")
        params.validate()
        self.validate(prompt_token_ids, params, len(output_token_ids or []))
        if params.bad_words and self.tokenizer is None:
            raise EngineInputError("bad_words needs the model's tokenizer, which this engine "
                                   "does not have")
        if num_speculative_tokens is not None and (
                type(num_speculative_tokens) is not int
                or not 0 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise EngineInputError(f"num_speculative_tokens must be an integer in [0, "
                                   f"{MAX_SPECULATIVE_TOKENS}], got {num_speculative_tokens!r}")
        if remote_kv is not None and params.prompt_logprobs is not None:
            raise EngineInputError("prompt_logprobs needs the prompt computed by this engine; "
                                   "it cannot come with remote KV")
        if remote_kv is not None and not 0 < remote_kv.num_tokens <= len(prompt_token_ids):
            # A prefix: the whole prompt (a prefill worker's KV) or its first blocks (a tier).
            raise EngineInputError(
                f"remote KV covers {remote_kv.num_tokens} tokens; it must cover 1 to "
                f"{len(prompt_token_ids)} (the prompt's length)")

    def check_priority(self, priority: int) -> None:
        """EngineInputError unless `priority` is an int32 this engine's policy takes (any but 0
        needs the "priority" policy, as in vLLM)."""
        if type(priority) is not int or not -(2**31) <= priority < 2**31:
            raise EngineInputError(f"priority must be a 32-bit integer, got {priority!r}")
        if priority and self.config.scheduler.policy != "priority":
            raise EngineInputError(f"priority {priority} asked for, but this engine schedules "
                                   "first come, first served (start it with the scheduling "
                                   "policy 'priority')")

    def enqueue(self, request_id: str, prompt_token_ids: list[int],
                params: SamplingParams | PoolingParams, *,
                output_token_ids: list[int] | None = None, remote_kv: RemoteKv | None = None,
                arrival_time: float | None = None,
                num_speculative_tokens: int | None = None,
                speculative_method: str | None = None,
                grammar: RequestGrammar | None = None,
                lora_name: str | None = None, priority: int = 0,
                cache_salt: str | None = None) -> Request:
        """Queue a request that passed `check_request` (callers validate off the engine thread,
        so the step loop does not scan the prompt twice), with its grammar from `make_grammar`
        when it asks for structured outputs."""
        if isinstance(params, PoolingParams):
            return self._enqueue_pooling(request_id, prompt_token_ids, params, arrival_time,
                                         lora_name, priority, cache_salt)
        if (grammar is None) != (params.structured_outputs is None):
            raise EngineInputError("a request with structured_outputs is queued with its "
                                   "grammar (LLMEngine.make_grammar), and only such a request")
        req = Request(request_id, prompt_token_ids, params, self.eos_token_ids, self.max_model_len,
                      output_token_ids=output_token_ids, remote_kv=remote_kv,
                      arrival_time=arrival_time, priority=priority)
        req.grammar = grammar
        if params.bad_words and self._encode_text is not None:  # (checked by check_request)
            req.bad_words_token_ids = bad_words_token_ids(params.bad_words, self._encode_text)
        self._bind_lora(req, lora_name, cache_salt)
        req.num_speculative_tokens = self._speculative_tokens(req, num_speculative_tokens)
        req.spec_method = (speculative_method if speculative_method in self.proposers
                           else self.config.speculative.method)
        self.scheduler.add_request(req)
        if self.detokenize and self.tokenizer is not None:
            self._detoks[request_id] = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output)
        return req

    def _enqueue_pooling(self, request_id: str, prompt_token_ids: list[int],
                         params: PoolingParams, arrival_time: float | None,
                         lora_name: str | None, priority: int = 0,
                         cache_salt: str | None = None) -> Request:
        """Queue an embedding request: no detokenizer, no grammar, no drafts."""
        req = Request(request_id, prompt_token_ids, _POOLING_SAMPLING, self.eos_token_ids,
                      self.max_model_len, arrival_time=arrival_time, priority=priority)
        req.pooling = PoolingState(self.resolve_pooling(params), req.num_prompt_tokens)
        self._bind_lora(req, lora_name, cache_salt)
        self.scheduler.add_request(req)
        return req

    def _bind_lora(self, req: Request, lora_name: str | None,
                   cache_salt: str | None = None) -> None:
        """Run `req` with adapter `lora_name` (None: the base model), its KV hashed under the
        adapter's root, salted by `cache_salt` when it has one."""
        req.lora_slot = self.lora_slot(lora_name)
        if lora_name is not None or cache_salt:
            req.hash_root = self.hash_root(lora_name, cache_salt)

    def hash_root(self, lora_name: str | None = None, cache_salt: str | None = None) -> bytes:
        """The root a prompt's block hashes chain from: the engine's, or adapter `lora_name`'s
        (EngineInputError for an adapter it does not serve), salted by `cache_salt`."""
        if lora_name is None:
            root = self.kv.root
        else:
            self.lora_slot(lora_name)
            found = self._lora_roots.get(lora_name)
            if found is None:  # removed on the engine thread since the line above
                raise EngineInputError(f"unknown LoRA adapter {lora_name!r}")
            root = found
        return salted_root(root, cache_salt) if cache_salt else root

    def _lora_root(self, adapter: LoRAAdapter) -> bytes:
        """Adapter `adapter`'s root: a name loaded again from other files gets another, so no
        block computed with the old weights is a prefix hit for the new ones."""
        return root_hash(self.fingerprint, f"{self.config.cache.tenant_salt}\x00lora\x00"
                                           f"{adapter.name}\x00{adapter.weights_id}")

    # ---- LoRA adapters at runtime (`LoRAConfig.max_loras` slots) ------------------------------

    @property
    def runtime_lora(self) -> bool:
        """Whether adapters can be added and removed while the engine runs."""
        return self.runner.lora is not None and self.runner.lora.slotted

    def lora_names(self) -> list[str]:
        """The adapters loaded now, by slot."""
        stack = self.runner.lora
        return [] if stack is None else [a.name for a in stack.adapters]

    def lora_requests(self) -> dict[str, tuple[int, int]]:
        """Each loaded adapter's unfinished requests: (running, waiting). Racy off the engine
        thread, as the scheduler's counts are (each collection is copied in one C call)."""
        stack = self.runner.lora
        if stack is None:
            return {}
        running = collections.Counter(r.lora_slot for r in list(self.scheduler.running))
        total = collections.Counter(r.lora_slot for r in list(self.scheduler.requests.values()))
        return {a.name: (running[slot], max(total[slot] - running[slot], 0))
                for slot, a in sorted(list(stack.loaded.items()))}

    def add_lora(self, name: str, path: str) -> None:
        """Read the PEFT adapter in directory `path`, check it against the model and write it
        into a free slot, so requests may name it from the next step on. Engine thread only.
        EngineInputError says why it cannot be: runtime loading off, a bad name, a name
        already loaded, no free slot, or what is wrong with the files."""
        stack = self._runtime_stack()
        try:
            LoRAConfig(modules=((name, path),)).validate()
        except ConfigError as e:
            raise EngineInputError(str(e)) from None
        if name in stack.slots:
            raise EngineInputError(f"LoRA adapter {name!r} has already been loaded (from "
                                   f"{stack.loaded[stack.slots[name]].path})")
        if len(stack.loaded) >= stack.max_loras:
            raise EngineInputError(f"all {stack.max_loras} LoRA slots are taken "
                                   f"({', '.join(self.lora_names())}); unload one first or "
                                   "start the engine with a larger max_loras")
        try:
            adapter = load_adapter(name, path, self.model_config, self.config.lora.max_lora_rank)
            root = self._lora_root(adapter)
            tp = self.runner.tp
            if tp is None:
                slot = stack.add(adapter)
            elif not tp.add_lora(name, path, lambda: stack.add(adapter),
                                 lambda: stack.remove(name)):
                raise EngineInputError(f"LoRA adapter {name!r}: a tensor-parallel rank could "
                                       "not load its share (its log says why); no rank has it")
            else:
                slot = stack.slot(name)
        except (LoRAError, ValueError) as e:
            raise EngineInputError(str(e)) from None
        self._lora_roots[name] = root
        logger.info("LoRA adapter %s loaded into slot %d: rank %d, %s (%s)", name, slot,
                    adapter.rank, ", ".join(sorted(adapter.targets)), path)

    def remove_lora(self, name: str) -> None:
        """Unload adapter `name`, freeing its slot. Engine thread only. EngineInputError when
        no adapter has the name or unfinished requests still run it."""
        stack = self._runtime_stack()
        slot = stack.slots.get(name)
        if slot is None:
            raise EngineInputError(f"no LoRA adapter {name!r} is loaded (loaded: "
                                   f"{', '.join(self.lora_names()) or 'none'})")
        users = sum(r.lora_slot == slot for r in self.scheduler.requests.values())
        if users:
            raise EngineInputError(f"LoRA adapter {name!r} is in use by {users} unfinished "
                                   "request(s); unload it once they are done")
        stack.remove(name)
        if self.runner.tp is not None:
            self.runner.tp.remove_lora(name)
        del self._lora_roots[name]
        logger.info("LoRA adapter %s unloaded from slot %d", name, slot)

    def _runtime_stack(self) -> LoRAStack:
        stack = self.runner.lora
        if not self.runtime_lora or stack is None:
            raise EngineInputError("this engine does not load LoRA adapters at runtime: start "
                                   "it with max_loras > 0 (--max-loras N)")
        return stack

    def prompt_key(self, lora_name: str | None = None, cache_salt: str | None = None) -> bytes:
        """What a KV handle's prompt hash binds besides the tokens (`prompt_hash`): the
        model's fingerprint, or for an adapter's or a salted prompt its root (32 bytes)."""
        return (self.hash_root(lora_name, cache_salt) if lora_name or cache_salt
                else self.fingerprint)

    def lora_slot(self, lora_name: str | None) -> int:
        """The runner's slot of adapter `lora_name` (0: None, the base model);
        EngineInputError naming the loaded adapters otherwise."""
        if lora_name is None:
            return 0
        stack = self.runner.lora
        if stack is None:
            raise EngineInputError(f"LoRA adapter {lora_name!r} asked for, but this engine "
                                   "serves none (start it with --lora-modules NAME=PATH or "
                                   "--max-loras N)")
        try:
            return stack.slot(lora_name)
        except KeyError:
            raise EngineInputError(f"unknown LoRA adapter {lora_name!r}; this engine serves "
                                   f"{sorted(stack.slots)}") from None

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
        self._detoks.pop(request_id, None)
        self._release_drafts(request_id)
        return self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED) is not None

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
        self.scheduler.expire_leases()
        out = self.scheduler.schedule()
        if out.kv_loads:
            self.runner.fence_kv_loads()  # before this step: see there
        self._kv_loads.extend(out.kv_loads)
        prev, self._inflight = self._inflight, None
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
        return outputs

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
            self._propose(req for req, _ in changed)
        return outputs

    def _propose(self, reqs: Iterable[Request]) -> None:
        """Draft the next step's tokens for the running requests that speculate and whose
        tokens are all on the host (drafts after a token still in flight would be stale)."""
        by_method: dict[str, list[Request]] = {}
        for req in reqs:
            if req.num_speculative_tokens and req.status == RequestStatus.RUNNING \
                    and not req.num_inflight:
                by_method.setdefault(req.spec_method, []).append(req)
        for method, ready in by_method.items():
            propose_all(ready, self.proposers[method],
                        self.config.speculative.min_accepted_per_step)

    def _step_output(self, req: Request, toks: list[SampledToken]) -> StepOutput:
        tokens = [t.token_id for t in toks]
        lp = [t.logprob for t in toks if t.logprob is not None]
        text = ""
        detok = self._detoks.get(req.request_id)
        if detok is not None:
            # One token at a time when a step emitted several (speculative decoding): a stop
            # string may end inside them, and the tokens after it are not part of the output,
            # exactly as plain decoding would never have produced them.
            for i, token in enumerate(tokens):
                res = detok.add_tokens([token])
                text += res.text_delta
                if res.stop_matched is not None:
                    del tokens[i + 1:]
                    del lp[i + 1:]
                    if not req.is_finished:
                        self.scheduler.finish_request(req.request_id,
                                                      RequestStatus.FINISHED_STOPPED)
                        req.stop_reason = res.stop_matched
                    break
        if req.is_finished:
            self._release_drafts(req.request_id)
            detok = self._detoks.pop(req.request_id, None)
            if detok is not None and not detok.finished:
                text += detok.finish().text_delta  # flush text held back for stop strings
        prompt_lps = None
        if req.sampling_params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            prompt_lps, req.prompt_logprobs_sent = req.prompt_logprobs, True
        pooled = None
        if req.pooling is not None and req.status == RequestStatus.FINISHED_POOLED:
            pooled = embedding(req.pooling)
            if self.classifier is not None:
                pooled = self.classifier.logits(pooled)
        return StepOutput(
            request_id=req.request_id, new_token_ids=tokens, new_logprobs=lp,
            prompt_logprobs=prompt_lps,
            finished=req.is_finished, finish_reason=req.status.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=max(req.num_cached_tokens, 0),
            text_delta=text, stop_reason=req.stop_reason,
            kv_held=req.status == RequestStatus.FINISHED_PREFILL,
            metrics=req.metrics if req.is_finished else None, embedding=pooled)


def check_cache_salt(cache_salt: str | None) -> None:
    """EngineInputError unless `cache_salt` is None or a valid salt (`cache_salt_problem`)."""
    problem = cache_salt_problem(cache_salt)
    if problem is not None:
        raise EngineInputError(problem)
