"""Offline benchmark: the engine in-process through its vLLM-like `LLM.generate` API.

Three modes:
- throughput: submit every request at once; report the `vllm bench serve` metrics computed
  from the engine's per-request timings (`RequestOutput.metrics`).
- latency: B requests of input length I and output length O at once; the decode step time
  at batch B is the median over steps of the per-step inter-token gap.
- embed: every prompt at once through `LLM.embed` (embeddings: prompts only, no output
  tokens); requests and prompt tokens per second over the call's wall time.
All engine timestamps are time.perf_counter based, like the wall clock taken here.
"""

from __future__ import annotations

import importlib
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench.metrics import RequestRecord
from bench.workloads import BenchRequest, assign_adapters, random_requests
from engine.config import DEFAULT_GC_THRESHOLD

WARMUP_SEED_OFFSET = 1_000_003


class OfflineBenchError(RuntimeError):
    """The engine did not provide what the benchmark needs; the message says what."""


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Arguments of `engine.LLM` used by the benchmarks."""

    model: str = "dummy:llama-3.1-8b"
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    enforce_eager: bool = False
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    attention_backend: str = "auto"
    gpu_memory_utilization: float = 0.85
    kv_cache_dtype: str = "auto"  # "fp8": float8 e4m3 KV cache (half the bytes of bf16)
    async_scheduling: bool | None = None  # None: the engine's default (on for CUDA)
    decode_overlap_min_batch: int = 0  # >= 2: two overlapped decode micro-batches
    cuda_graph_max_batch: int = 512  # the engine's default
    piecewise_graph_max_tokens: int = 512  # the engine's default; 0: steps with prompts eager
    quantization: str = "none"  # "fp8": W8A8
    # The engine's GC thresholds; None: the interpreter's.
    gc_threshold: tuple[int, int, int] | None = DEFAULT_GC_THRESHOLD
    # Speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4}; None: off.
    speculative_config: dict[str, Any] | None = None
    # LoRA adapters to load, name -> PEFT directory (requests pick among them); None: none.
    lora_modules: dict[str, str] | None = None

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs = asdict(self)
        if self.max_model_len is None:
            del kwargs["max_model_len"]
        return kwargs


def _engine_attr(name: str) -> Any:
    # Imported at call time (the engine pulls in torch) and looked up by name, so this module
    # type-checks and imports while the engine's public API is still being written.
    module = importlib.import_module("engine")
    try:
        return getattr(module, name)
    except AttributeError as e:
        raise OfflineBenchError(f"the engine does not export {name} (needed: engine.{name})") from e


def build_llm(settings: EngineSettings) -> Any:
    return _engine_attr("LLM")(**settings.llm_kwargs())


def generate(llm: Any, requests: list[BenchRequest]) -> list[Any]:
    """One `generate` call for all requests (greedy, forced lengths); outputs in input order.

    One SamplingParams when all output lengths agree, else one per prompt (as vLLM accepts).
    """
    sampling_params = _engine_attr("SamplingParams")
    params = [sampling_params(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    same = len({r.output_len for r in requests}) == 1
    if any(r.lora_name for r in requests):  # one LoRA adapter (or None) per prompt
        return list(llm.generate(prompts, params[0] if same else params,
                                 lora_request=[r.lora_name for r in requests]))
    return list(llm.generate(prompts, params[0] if same else params))


def _timing(output: Any, name: str, index: int) -> float:
    metrics = getattr(output, "metrics", None)
    value = getattr(metrics, name, None)
    if value is None:
        raise OfflineBenchError(
            f"engine output {index} has no metrics.{name}: the offline benchmark needs "
            "RequestOutput.metrics with arrival_time, first_token_time, finished_time "
            "(time.perf_counter based) and token_times"
        )
    return float(value)


def record_from_output(output: Any, request: BenchRequest, index: int) -> RequestRecord:
    completions = getattr(output, "outputs", None)
    if not completions:
        raise OfflineBenchError(f"engine output {index} has no .outputs[0]")
    token_ids = list(getattr(completions[0], "token_ids", []))
    first = _timing(output, "first_token_time", index)  # raises first when metrics are absent
    token_times = [float(t) for t in getattr(output.metrics, "token_times", None) or []]
    return RequestRecord(
        prompt_len=request.prompt_len,
        output_len=len(token_ids),
        start_time=_timing(output, "arrival_time", index),
        first_token_time=first,
        token_times=token_times or [first],
        end_time=_timing(output, "finished_time", index),
        success=True,
    )


def run_throughput(llm: Any, requests: list[BenchRequest]) -> tuple[list[RequestRecord], float]:
    """All requests at once; returns per-request records and the wall duration."""
    start = time.perf_counter()
    outputs = generate(llm, requests)
    duration = time.perf_counter() - start
    if len(outputs) != len(requests):
        raise OfflineBenchError(f"engine returned {len(outputs)} outputs for {len(requests)} prompts")
    return [record_from_output(o, r, i) for i, (o, r) in
            enumerate(zip(outputs, requests, strict=True))], duration


@dataclass(frozen=True, slots=True)
class LatencyResult:
    """Decode step latency at a fixed batch size."""

    batch_size: int
    input_len: int
    output_len: int
    median_itl_ms: float | None   # median over decode steps of the per-step gap
    mean_itl_ms: float | None
    p99_itl_ms: float | None
    median_ttft_ms: float         # over the batch's requests
    duration_s: float             # wall time of the measured generate call
    output_tok_s: float
    itl_source: str               # "token_times" or "tpot" (engine gave no per-token times)


def step_itls(records: list[RequestRecord]) -> tuple[list[float], str]:
    """Per-step gaps (s): step k's gap is the median over requests of token k - token k-1.

    Falls back to each request's TPOT when the engine gave no per-token times.
    """
    num_steps = min(len(r.token_times) for r in records) - 1
    if num_steps >= 1:
        return [statistics.median(r.token_times[k] - r.token_times[k - 1] for r in records)
                for k in range(1, num_steps + 1)], "token_times"
    return [t for r in records if (t := r.tpot) is not None], "tpot"


def run_latency(llm: Any, batch_size: int, input_len: int, output_len: int, vocab_size: int,
                seed: int = 0, warmup: bool = True,
                lora_names: list[str] | None = None) -> LatencyResult:
    """B requests of I input / O output tokens at once (after a short warm-up of the same B, I);
    `lora_names`: LoRA adapters the requests pick among at random (None: the base model).

    Callers measuring several runs must use distinct seeds: equal prompts hit the prefix cache.
    """
    names = lora_names or []
    requests = assign_adapters(random_requests(batch_size, input_len, output_len, vocab_size,
                                               seed=seed), names, seed)
    if warmup:
        # Other prompts than the measured ones (a seed no caller uses for measured runs), so
        # the prefix cache cannot shorten their prefill.
        generate(llm, assign_adapters(random_requests(
            batch_size, input_len, min(output_len, 4), vocab_size,
            seed=seed + WARMUP_SEED_OFFSET), names, seed))
    records, duration = run_throughput(llm, requests)
    gaps, source = step_itls(records)
    gaps_ms = np.asarray(gaps, dtype=np.float64) * 1000.0
    has_gaps = gaps_ms.size > 0
    return LatencyResult(
        batch_size=batch_size,
        input_len=input_len,
        output_len=output_len,
        median_itl_ms=float(np.median(gaps_ms)) if has_gaps else None,
        mean_itl_ms=float(np.mean(gaps_ms)) if has_gaps else None,
        p99_itl_ms=float(np.percentile(gaps_ms, 99)) if has_gaps else None,
        median_ttft_ms=statistics.median(r.ttft for r in records) * 1000.0,
        duration_s=duration,
        output_tok_s=sum(r.output_len for r in records) / duration,
        itl_source=source,
    )


@dataclass(frozen=True, slots=True)
class EmbedResult:
    """Embedding throughput: every prompt at once through `LLM.embed`."""

    completed: int
    total_input_tokens: int
    duration_s: float
    request_throughput: float      # prompts embedded per second
    input_token_throughput: float  # prompt tokens per second
    embedding_dim: int


def run_embed(llm: Any, requests: list[BenchRequest], warmup: bool = True) -> EmbedResult:
    """Embed every request's prompt in one `LLM.embed` call (their output lengths are ignored);
    first, when `warmup`, a few of the prompts reversed (same lengths, so kernels compile
    outside the measured call; other leading blocks, so no prefix-cache hit)."""
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    if warmup:
        llm.embed([{"prompt_token_ids": r.prompt_token_ids[::-1]} for r in requests[:4]])
    start = time.perf_counter()
    outputs = list(llm.embed(prompts))
    duration = time.perf_counter() - start
    if len(outputs) != len(requests):
        raise OfflineBenchError(f"engine returned {len(outputs)} embeddings for "
                                f"{len(requests)} prompts")
    dims = {len(o.outputs.embedding) for o in outputs}
    if len(dims) != 1 or 0 in dims:
        raise OfflineBenchError(f"embeddings of unequal or zero size: {sorted(dims)}")
    tokens = sum(r.prompt_len for r in requests)
    return EmbedResult(completed=len(outputs), total_input_tokens=tokens, duration_s=duration,
                       request_throughput=len(outputs) / duration,
                       input_token_throughput=tokens / duration, embedding_dim=dims.pop())
