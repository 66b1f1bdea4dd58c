"""Offline API mirroring vLLM's: `LLM(model=...)`, `llm.generate(prompts, params)`, `llm.chat`,
`llm.embed(prompts)`."""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from tqdm import tqdm

from engine.config import (
    DEFAULT_GC_THRESHOLD,
    DEFAULT_MAX_LORA_RANK,
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoadConfig,
    LoRAConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    kv_cache_dtype_name,
    speculative_config_from_dict,
)
from engine.llm_engine import LLMEngine
from engine.lora import LoRARequest, lora_name_of
from engine.outputs import (
    BeamSearchOutput,
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    StepOutput,
)
from engine.request import RequestMetrics
from engine_api.beam_search import BeamSearch, BeamSearchParams, BeamSearchParamsError
from engine_api.classify import probabilities
from engine_api.errors import EngineInputError
from engine_api.generation_defaults import (
    MODES,
    GenerationConfigError,
    resolve_sampling_defaults,
    sampling_defaults,
)
from engine_api.pooling_params import PoolerConfig, PoolingParams, PoolingType
from engine_api.request_options import RequestOptions
from engine_api.sampling_params import SamplingParams, truncate_prompt

PromptType = str | dict[str, Any]
LoRAArg = LoRARequest | str | Sequence[LoRARequest | str | None] | None
T = TypeVar("T")


class LLM:
    """An engine in this process. Keyword names follow vLLM's `LLM` where the concept exists."""

    def __init__(
        self,
        model: str = "",
        *,
        tokenizer: str | None = None,
        load_format: str = "auto",
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        num_gpu_blocks: int | None = None,
        gpu_memory_utilization: float = 0.85,
        cpu_kv_cache_bytes: int | None = None,
        kv_cache_dtype: str = "auto",
        kv_scales: str | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        async_scheduling: bool | None = None,
        gc_threshold: tuple[int, int, int] | None = DEFAULT_GC_THRESHOLD,
        device: str = "auto",
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        cuda_graph_max_batch: int = 512,
        decode_overlap_min_batch: int = 0,
        piecewise_graph_max_tokens: int = 512,
        quantization: str = "none",
        cpu_threads: int | None = None,
        tensor_parallel_size: int = 1,
        lora_modules: dict[str, str] | None = None,
        max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
        enable_lora: bool = False,
        max_loras: int = 0,
        speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
        pooling_type: PoolingType | None = None,
        classifier_from_token: Sequence[str] = (),
        scheduling_policy: str = "fcfs",
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
    ) -> None:
        """`speculative_config` as in vLLM: e.g. {"method": "ngram", "num_speculative_tokens":
        4, "prompt_lookup_max": 4} (the fields of `SpeculativeConfig`), or {"model": <draft>,
        "num_speculative_tokens": 4} for a draft model (the method follows from `model`).
        `lora_modules`: LoRA adapters by name -> PEFT directory, loaded now; `generate(...,
        lora_request=name)` runs a prompt with one. `max_loras` > 0 (or `enable_lora`: one
        slot per module, at least one): that many adapter slots, and a `LoRARequest` with a
        path loads its adapter on first use, as in vLLM (the least recently used adapter is
        unloaded when the slots are full). `pooling_type`: how `embed` pools by
        default ("LAST", "MEAN", "CLS"; None: the model's sentence-transformers configuration,
        else LAST). `classifier_from_token`: serve the model as a classifier over its LM head's
        rows for these tokens (["no", "yes"]: one yes-minus-no score; engine/classifier.py),
        for `classify` and `score`. `scheduling_policy`: "fcfs" or "priority" (`generate(..., priority=)`).
        `generation_config` ("auto": the model's generation_config.json; "vllm": none; or a
        directory) and `override_generation_config` give `get_default_sampling_params`, which
        `generate` and `stream` use when no sampling params are given (as vLLM's do)."""
        if isinstance(speculative_config, dict):
            try:
                speculative_config = speculative_config_from_dict(speculative_config)
            except ConfigError as e:
                raise EngineInputError(f"speculative_config: {e}") from None
        config = EngineConfig(
            load=LoadConfig(model=model, load_format=load_format, dtype=dtype, seed=seed,  # type: ignore[arg-type]
                            tokenizer=tokenizer),
            cache=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                              num_gpu_blocks=num_gpu_blocks,
                              gpu_memory_utilization=gpu_memory_utilization,
                              cpu_kv_cache_bytes=cpu_kv_cache_bytes,
                              kv_cache_dtype=kv_cache_dtype_name(kv_cache_dtype),  # type: ignore[arg-type]
                              kv_scales=kv_scales),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      enable_chunked_prefill=enable_chunked_prefill,
                                      max_model_len=max_model_len,
                                      async_scheduling=async_scheduling,
                                      gc_threshold=gc_threshold,
                                      policy=scheduling_policy),  # type: ignore[arg-type]
            runner=RunnerConfig(device=device, attention_backend=attention_backend,  # type: ignore[arg-type]
                                enforce_eager=enforce_eager,
                                cuda_graph_max_batch=cuda_graph_max_batch,
                                decode_overlap_min_batch=decode_overlap_min_batch,
                                piecewise_graph_max_tokens=piecewise_graph_max_tokens,
                                quantization=quantization,  # type: ignore[arg-type]
                                cpu_threads=cpu_threads),
            speculative=speculative_config or SpeculativeConfig(),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            lora=LoRAConfig(modules=tuple((lora_modules or {}).items()),
                            max_lora_rank=max_lora_rank,
                            max_loras=max_loras or (max(1, len(lora_modules or {}))
                                                    if enable_lora else 0)),
            pooler=PoolerConfig(pooling_type=pooling_type,
                                classifier_from_token=tuple(classifier_from_token)),
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._lora_lru: dict[str, None] = {}  # adapter names, least recently used first
        self._set_sampling_defaults(generation_config, override_generation_config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        self = cls.__new__(cls)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._lora_lru = {}
        self._set_sampling_defaults("auto", None)
        return self

    def _set_sampling_defaults(self, mode: str, override: dict[str, Any] | None) -> None:
        try:
            if mode in MODES:
                self._sampling_defaults = sampling_defaults(
                    {} if mode == "vllm" else self.engine.generation_config, override)
            else:
                self._sampling_defaults = resolve_sampling_defaults(mode, None, override)
        except GenerationConfigError as e:
            self.shutdown()
            raise EngineInputError(str(e)) from None

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: `SamplingParams` with the model's recommended values (its
        generation_config.json's temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens, where they differ from Hugging Face's defaults), neutral ones else."""
        return SamplingParams(**self._sampling_defaults)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        """Let `del llm; gc.collect()` free the engine and its device memory (the engine's start
        froze its heap; see `LLMEngine.shutdown`)."""
        self.engine.shutdown()

    def get_tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    # ---- generation ------------------------------------------------------------------------

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request: LoRAArg = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`.
        `lora_request`: the loaded LoRA adapter (by name, or vLLM's `LoRARequest`) the prompts
        run with, or one per prompt (as vLLM accepts); None: the base model. `priority`: one
        per prompt (lower sooner), for an engine with the "priority" scheduling policy."""
        items = self._submit(prompts, sampling_params, self._lora_names(lora_request), priority)
        # vLLM's progress bar: completions finished of those asked for (use_tqdm=True).
        with tqdm(total=sum(len(out.outputs) for _, out in items), desc="Processed prompts",
                  unit=" completions", disable=not use_tqdm, file=sys.stderr) as bar:
            for steps in self._run():
                bar.update(sum(1 for s in steps if s.finished and ":" in s.request_id))
        for _, out in items:
            self._finalize(out)
        return [out for _, out in items]

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = False, lora_request: LoRAArg = None
              ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (its pooled final hidden state: engine/pooling.py), in the
        order of `prompts`. `pooling_params`: one for all or one per prompt; None: the engine's
        pooling (`pooling_type`, the model's). `lora_request` as in `generate`."""
        plist = _prompt_list(prompts)
        params = ([pooling_params or PoolingParams()] * len(plist)
                  if pooling_params is None or isinstance(pooling_params, PoolingParams)
                  else _one_each(list(pooling_params), len(plist), "pooling params"))
        loras = _per_prompt(self._lora_names(lora_request), len(plist))
        tokenized = [self._truncated(self._tokenize(prompt), pp.truncate_prompt_tokens)
                     for prompt, pp in zip(plist, params, strict=True)]
        options = [RequestOptions(pp, lora_name=lora) for pp, lora in zip(params, loras,
                                                                           strict=True)]
        for (_, ids), opts in zip(tokenized, options, strict=True):
            self.engine.check_request(ids, opts)  # all before any is queued
        outs: dict[str, EmbeddingRequestOutput] = {}
        for (text, ids), opts in zip(tokenized, options, strict=True):
            rid = f"embed-{next(self._ids)}"
            self.engine.enqueue(rid, ids, opts)
            outs[rid] = EmbeddingRequestOutput(rid, EmbeddingOutput([]), ids, finished=False,
                                               prompt=text)
        while self.engine.has_unfinished_requests():
            for s in self.engine.step():
                out = outs.get(s.request_id)
                if out is not None and s.embedding is not None:
                    out.outputs.embedding, out.finished = s.embedding, True
                    out.num_cached_tokens = s.num_cached_tokens
        return list(outs.values())

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRAArg = None) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search` (engine_api/beam_search.py): per prompt its best `beam_width`
        sequences, best first, each with its tokens, text and cumulative logprob. Every step
        runs all prompts' live beams together for one token; `max_tokens` stops at the model's
        context."""
        tok = self.engine.tokenizer
        searches = []
        for prompt in _prompt_list(prompts):
            _, ids = self._tokenize(prompt)
            try:
                searches.append(BeamSearch(ids, params, self.engine.eos_token_ids,
                                           self.engine.max_model_len))
            except BeamSearchParamsError as e:
                raise EngineInputError(str(e)) from None
        step = SamplingParams(temperature=params.temperature, max_tokens=1, ignore_eos=True,
                              logprobs=params.num_candidates)
        while live := [s for s in searches if not s.done]:
            beams = [(s, b) for s in live for b in s.beams]
            outs = self.generate([{"prompt_token_ids": b.tokens} for _, b in beams], step,
                                 lora_request=lora_request)
            cursor = 0
            for s in live:
                n = len(s.beams)
                s.expand([_candidates(o) for o in outs[cursor:cursor + n]])
                cursor += n
        results = []
        for s in searches:
            best = s.results()
            for seq in best:
                seq.text = "" if tok is None else tok.decode(seq.output_token_ids)
            results.append(BeamSearchOutput(best))
        return results

    def classify(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = False,
                 lora_request: LoRAArg = None) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (`ClassificationOutput`), in order, on a classifier:
        a `*ForSequenceClassification` checkpoint or `classifier_from_token`."""
        labels = self._class_labels()
        results = []
        for out in self.embed(prompts, use_tqdm=use_tqdm, lora_request=lora_request):
            logits = out.outputs.embedding
            if len(logits) != len(labels):  # the engine's bug, not the caller's
                raise RuntimeError(f"a classification came back with {len(logits)} values for "
                                   f"{len(labels)} labels")
            results.append(ClassificationRequestOutput(out.request_id, ClassificationOutput(
                probabilities(logits), list(logits)), out.prompt_token_ids))
        return results

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              use_tqdm: bool = False, lora_request: LoRAArg = None
              ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: one text against each of `data_2`, or pair by pair. A one-label
        classifier (a cross-encoder) reads each pair as one input (`Tokenizer.encode_pair`) and
        scores it with its label's probability; an embedding model scores the cosine similarity
        of the two texts' normalized embeddings."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(first) == 1:
            first = first * len(second)
        if not second or len(first) != len(second):
            raise EngineInputError(f"score: {len(first)} first texts for {len(second)} second "
                                   "ones: give one, or as many as the second")
        cross = self.engine.classifier is not None
        if cross and len(self._class_labels()) != 1:
            raise EngineInputError(f"score needs a one-label classifier (a cross-encoder); this "
                                   f"one has {len(self._class_labels())} labels: use classify")
        tok = self.engine.tokenizer
        if tok is None or not all(isinstance(t, str) and t for t in (*first, *second)):
            raise EngineInputError("score takes non-empty texts and needs the model's tokenizer")
        if cross:
            pairs = [tok.encode_pair(a, b) for a, b in zip(first, second, strict=True)]
            outs = self.classify([{"prompt_token_ids": ids} for ids in pairs], use_tqdm,
                                 lora_request)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.probs[0]),
                                         o.prompt_token_ids) for o in outs]
        unit = PoolingParams(normalize=True)
        a = self.embed(first, unit, use_tqdm, lora_request)
        b = self.embed(second, unit, use_tqdm, lora_request)
        return [ScoringRequestOutput(x.request_id, ScoringOutput(
                    sum(p * q for p, q in zip(x.outputs.embedding, y.outputs.embedding,
                                              strict=True))),
                    x.prompt_token_ids + y.prompt_token_ids) for x, y in zip(a, b, strict=True)]

    def _class_labels(self) -> tuple[str, ...]:
        labels = self.engine.class_labels
        if not labels:
            raise EngineInputError("this model is not a classifier: load a "
                                   "*ForSequenceClassification checkpoint or pass "
                                   "classifier_from_token")
        return labels

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None
               ) -> Iterator[StepOutput]:
        """Generate for one prompt, yielding each step's new tokens and text as they come."""
        params = sampling_params or self.get_default_sampling_params()
        if params.n != 1:
            raise EngineInputError("stream() supports n=1 only")
        [(rid, _)] = self._submit(prompt, params)
        try:
            for step in self._run():
                for s in step:
                    if s.request_id.startswith(rid + ":"):
                        yield s
        finally:
            for child in list(self.engine.scheduler.requests):
                if child.startswith(rid + ":"):
                    self.engine.abort_request(child)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        tok = self.engine.tokenizer
        if tok is None:
            raise EngineInputError("this model has no tokenizer; chat needs one")
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        prompts: list[PromptType] = [
            {"prompt_token_ids": tok.encode(
                tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt),  # type: ignore[arg-type]
                add_special_tokens=False)}
            for c in convs]
        return self.generate(prompts, sampling_params)

    # ---- internals -------------------------------------------------------------------------

    def _lora_names(self, lora_request: LoRAArg) -> str | list[str | None] | None:
        """The adapters' names (one for all, or one per prompt) of a `lora_request`, after
        loading those a `LoRARequest` names with a path that the engine does not hold yet
        (an engine with `max_loras` slots)."""
        requests = (list(lora_request) if isinstance(lora_request, (list, tuple))
                    else [lora_request])
        self._load_missing([r for r in requests if isinstance(r, LoRARequest)])
        loaded = self._loaded_loras()
        if isinstance(lora_request, (list, tuple)):
            return [lora_name_of(r, loaded) for r in lora_request]
        return lora_name_of(lora_request, loaded)  # type: ignore[arg-type]

    def _loaded_loras(self) -> dict[str, str]:
        """Loaded adapters: name -> the directory each was read from."""
        stack = self.engine.runner.lora
        return {} if stack is None else {a.name: a.path for a in stack.adapters}

    def _load_missing(self, requests: list[LoRARequest]) -> None:
        """Load the adapters `requests` name that are not loaded (vLLM's on-demand loading);
        when the slots are full, unload the least recently used ones this call does not need.
        Between `generate` calls no request is in flight, so any adapter may go."""
        stack = self.engine.runner.lora
        needed = {r.lora_name: r.lora_path for r in requests}
        for name in needed:  # most recently used last
            self._lora_lru.pop(name, None)
            self._lora_lru[name] = None
        missing = {n: p for n, p in needed.items() if p and n not in self._loaded_loras()}
        if not missing or stack is None or not self.engine.runtime_lora:
            return  # lora_name_of / the engine refuse what is not loaded, by name
        if len(needed) > stack.max_loras:
            raise EngineInputError(f"{len(needed)} LoRA adapters in one call, but the engine "
                                   f"has {stack.max_loras} slots (max_loras)")
        for name, path in missing.items():
            if len(stack.loaded) >= stack.max_loras:
                order = {n: i for i, n in enumerate(self._lora_lru)}
                victim = min((n for n in stack.slots if n not in needed),
                             key=lambda n: order.get(n, -1))  # unseen here: oldest
                self.engine.remove_lora(victim)
            self.engine.add_lora(name, path)

    def _submit(self, prompts: PromptType | Sequence[PromptType],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                lora_name: str | Sequence[str | None] | None = None,
                priority: Sequence[int] | None = None
                ) -> list[tuple[str, RequestOutput]]:
        plist = _prompt_list(prompts)
        params = ([sampling_params or self.get_default_sampling_params()] * len(plist)
                  if sampling_params is None or isinstance(sampling_params, SamplingParams)
                  else _one_each(list(sampling_params), len(plist), "sampling params"))
        loras = _per_prompt(lora_name, len(plist))
        priorities = [0] * len(plist) if priority is None else _one_each(
            list(priority), len(plist), "priorities")
        # Tokenize and validate every prompt before queueing any: a bad one must not leave the
        # others queued in the engine.
        tokenized = [self._truncated(self._tokenize(prompt), sp.truncate_prompt_tokens)
                     for prompt, sp in zip(plist, params, strict=True)]
        options = [RequestOptions(sp, lora_name=lora, priority=prio,
                                  cache_salt=_cache_salt(prompt))
                   for prompt, sp, lora, prio in zip(plist, params, loras, priorities, strict=True)]
        for (_, ids), sp, opts in zip(tokenized, params, options, strict=True):
            self.engine.check_request(ids, opts)
            self.engine.make_grammar(sp)  # compiles (and checks) a constraint; cached for below
        items = []
        for (text, ids), sp, opts in zip(tokenized, params, options, strict=True):
            rid = str(next(self._ids))
            for i in range(sp.n):
                # The prompt is scored once, by the first child (its logprobs are the prompt's).
                child = sp if sp.n == 1 else dataclasses.replace(
                    sp, n=1, seed=None if sp.seed is None else sp.seed + i,
                    prompt_logprobs=sp.prompt_logprobs if i == 0 else None)
                self.engine.enqueue(f"{rid}:{i}", ids, dataclasses.replace(opts, params=child),
                                    grammar=self.engine.make_grammar(child))  # one per child
            items.append((rid, RequestOutput(rid, text, ids, [
                CompletionOutput(i, "", [], [] if sp.logprobs is not None else None, None)
                for i in range(sp.n)], finished=False)))
        self._outputs = {rid: out for rid, out in items}
        self._metrics: dict[str, RequestMetrics] = {}
        return items

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            tok = self.engine.tokenizer
            if tok is None:
                raise EngineInputError("text prompts need a tokenizer; pass prompt_token_ids")
            if not prompt:
                raise EngineInputError("prompt must not be empty")
            return prompt, tok.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise EngineInputError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        raise EngineInputError("a prompt is a string or {'prompt_token_ids': [...]}")

    def _truncated(self, tokenized: tuple[str | None, list[int]], keep: int | None
                   ) -> tuple[str | None, list[int]]:
        """`truncate_prompt_tokens`: the prompt's last `keep` token ids (the text unchanged)."""
        text, ids = tokenized
        return text, truncate_prompt(ids, keep, self.engine.max_model_len)

    def _run(self) -> Iterator[list[StepOutput]]:
        while self.engine.has_unfinished_requests():
            steps = self.engine.step()
            for s in steps:
                self._accumulate(s)
            yield steps

    def _accumulate(self, s: StepOutput) -> None:
        if ":" not in s.request_id:
            return  # a request added to the engine directly, not through this LLM
        rid, idx = s.request_id.rsplit(":", 1)
        out = self._outputs.get(rid)
        if out is None:
            return
        comp = out.outputs[int(idx)]
        comp.token_ids.extend(s.new_token_ids)
        comp.text += s.text_delta
        if comp.logprobs is not None:
            comp.logprobs.extend(s.new_logprobs)
        out.num_cached_tokens = max(out.num_cached_tokens, s.num_cached_tokens)
        if s.prompt_logprobs is not None:
            out.prompt_logprobs = [None, *s.prompt_logprobs.entries()]
        if s.finished:
            comp.finish_reason = s.finish_reason
            comp.stop_reason = s.stop_reason
            if s.metrics is not None:
                self._metrics[s.request_id] = s.metrics

    def _finalize(self, out: RequestOutput) -> None:
        out.finished = True
        for comp in out.outputs:
            if comp.logprobs:
                comp.cumulative_logprob = sum(lp.logprob for lp in comp.logprobs)
        out.metrics = self._metrics.get(out.request_id + ":0")
        out.children_metrics = [m for i in range(len(out.outputs))
                                if (m := self._metrics.get(f"{out.request_id}:{i}")) is not None]


def _cache_salt(prompt: PromptType) -> str | None:
    """vLLM's prompt-dict `cache_salt` (None: none; checked by `RequestOptions`)."""
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None


def _candidates(out: RequestOutput) -> list[tuple[int, float]]:
    """A one-token step's top logprobs: (token id, logprob), best first."""
    [completion] = out.outputs
    if not completion.logprobs:
        raise RuntimeError("a beam search step came back without logprobs")
    return list(completion.logprobs[0].top)


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    return [prompts] if isinstance(prompts, (str, dict)) else list(prompts)


def _per_prompt(lora_name: str | Sequence[str | None] | None, n: int) -> list[str | None]:
    """One adapter name (or None) per prompt: the same for all, or one each."""
    if lora_name is None or isinstance(lora_name, str):
        return [lora_name] * n
    return _one_each(lora_name, n, "LoRA requests")


def _one_each(values: Sequence[T], n: int, what: str) -> list[T]:
    """`values`, which must hold one per prompt (`what` names them in the error)."""
    if len(values) != n:
        raise EngineInputError(f"got {len(values)} {what} for {n} prompts")
    return list(values)
