"""Draft-model proposer: a smaller model with the target's vocabulary drafts each request's next
tokens greedily, all of a step's requests in one batch (vLLM's `draft_model` method).

The draft runs as an engine of its own (`LLMEngine`, no tokenizer, no speculation) on the
target's device: its own weights, KV cache, scheduler and CUDA graphs. Each proposal is a
request of that engine whose prompt is the sequence so far and whose output is the k drafts:
one step catches the draft up (its prefix cache holds every full block it computed before, so
only the last partial block and the tokens accepted since are new), then k - 1 decode steps.
The draft keeps no state between proposals apart from that cache, so rejected drafts need no
rollback there, a preempted or disaggregated request (its target KV from a prefill worker) just
misses the cache once, and an evicted block is recomputed.

Drafts are the draft model's argmax. The rejection sampler treats them as one-hot proposals,
which keeps the target's distribution exact for every sampling setting; random sampling
accepts fewer of them than drafts sampled from the draft's own distribution would.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence

from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoadConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.llm_engine import LLMEngine
from engine.loader import load_model_source
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def draft_load_config(target: EngineConfig) -> LoadConfig:
    """The draft's weights (`SpeculativeConfig.model`) in the target's dtype."""
    return LoadConfig(model=target.speculative.model, dtype=target.load.dtype,
                      seed=target.load.seed)


def draft_engine_config(target: EngineConfig, draft_max_len: int) -> EngineConfig:
    """The draft engine's settings: the target's device, dtype, block size, batch limits and
    CUDA-graph settings; its own weights and memory share; a plain colocated engine."""
    spec = target.speculative
    return EngineConfig(
        load=draft_load_config(target),
        # As many blocks as the target's when it was given a number (the draft then holds as
        # many tokens), else sized as the target would be, from the draft's memory share.
        cache=CacheConfig(block_size=target.cache.block_size, enable_prefix_caching=True,
                          num_gpu_blocks=target.cache.num_gpu_blocks,
                          gpu_memory_utilization=spec.draft_gpu_memory_utilization,
                          cpu_kv_cache_bytes=target.cache.cpu_kv_cache_bytes),
        scheduler=SchedulerConfig(
            max_num_seqs=target.scheduler.max_num_seqs,
            max_num_batched_tokens=target.scheduler.max_num_batched_tokens,
            max_model_len=draft_max_len, role="colocated",
            async_scheduling=target.scheduler.async_scheduling,
            gc_threshold=None),  # the target engine owns the process's collector settings
        runner=dataclasses.replace(target.runner, quantization="none",
                                   decode_overlap_min_batch=0),
        speculative=SpeculativeConfig(),
    )


class DraftModelProposer:
    def __init__(self, target: EngineConfig, vocab_size: int,
                 max_model_len: int | None = None) -> None:
        spec = target.speculative
        draft_cfg = load_model_source(draft_load_config(target)).config
        if draft_cfg.vocab_size != vocab_size:
            raise ConfigError(
                f"the draft model's vocabulary ({draft_cfg.vocab_size} tokens) differs from the "
                f"target's ({vocab_size}); a draft must share the target's tokenizer")
        # Sequences longer than the draft's context get no drafts; within it, exact attention.
        limit = draft_cfg.max_position_embeddings
        if draft_cfg.sliding_window is not None:
            limit = min(limit, draft_cfg.sliding_window)
        if max_model_len is not None:
            limit = min(limit, max_model_len)
        self.engine = LLMEngine(draft_engine_config(target, limit), detokenize=False)
        self._ids = itertools.count()
        # Counters for benchmarks and tests: proposal rounds, the draft engine's steps, and the
        # prompt tokens it was given and computed (the rest came from its prefix cache).
        self.num_rounds = 0
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_computed_tokens = 0
        self.busy_s = 0.0
        logger.info("draft model %s: %d layers, %d KV blocks", spec.model,
                    draft_cfg.num_hidden_layers, self.engine.info.num_blocks)

    def propose_batch(self, sequences: Sequence[list[int]], ks: Sequence[int]) -> list[list[int]]:
        start = time.perf_counter()
        eng = self.engine
        asked: dict[str, int] = {}
        for i, (seq, k) in enumerate(zip(sequences, ks, strict=True)):
            # The draft request stops at its max_model_len: ask only for what fits there.
            k = min(k, eng.max_model_len - len(seq))
            if k <= 0:
                continue
            rid = f"draft-{next(self._ids)}"
            # The target's own tokens: validated when they entered it (same vocabulary).
            eng.enqueue(rid, list(seq),
                        SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True))
            asked[rid] = i
        drafts: list[list[int]] = [[] for _ in sequences]
        steps = 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                drafts[asked[out.request_id]].extend(out.new_token_ids)
                if out.finished:
                    self.num_prompt_tokens += out.num_prompt_tokens
                    self.num_computed_tokens += out.num_prompt_tokens - out.num_cached_tokens
            steps += 1
        self.num_rounds += 1
        self.num_steps += steps
        self.busy_s += time.perf_counter() - start
        return drafts

    def shutdown(self) -> None:
        self.engine.shutdown()
