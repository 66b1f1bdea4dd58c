"""The H200 benchmark suite in one process (steps b-e of `tools/gpu/run_h200.sh`).

Loads the dummy model once per engine configuration (eager, then CUDA graphs) and runs, in
order: decode ITL at batch 1/8/64 eager and graph-captured, TTFT of one 4096-token prompt,
offline throughput on `random` 1000 in / 1000 out, 128 requests of 512 in / 128 out through
the engine, and the `transformers` baseline at batch 128 on the same shape. After every step
the results so far are written to `<out-dir>/suite.json`, so a killed run keeps what it did.
Each step has its own deadline (SIGALRM); a step that fails or runs out of time is recorded
with its error and the suite goes on, with a fresh engine if the old one may be inconsistent.

Usage: PYTHONPATH=. python3 tools/gpu/h200_suite.py --out-dir "$OUT" [--small] [--steps a,b]
(`--small` shrinks every shape for a smoke test on a small GPU or the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from bench import models, offline
from bench.metrics import compute_metrics
from bench.results import environment_info, write_json
from bench.workloads import random_requests


# A BaseException, so engine code catching Exception cannot swallow the deadline.
class StepTimeout(BaseException):
    """A suite step ran past its deadline."""


DEFAULT_MODEL = "dummy:llama-3.1-8b"


@dataclass(frozen=True, slots=True)
class SuiteSizes:
    """Every shape the suite runs; `small()` is the smoke-test variant."""

    model: str = DEFAULT_MODEL
    latency_batches: tuple[int, ...] = (1, 8, 64)
    latency_input_len: int = 1024
    latency_output_len: int = 128
    ttft_input_len: int = 4096
    ttft_repeats: int = 3
    tput_num_prompts: int = 1000
    tput_input_len: int = 1000
    tput_output_len: int = 1000
    conc_num_prompts: int = 128
    conc_input_len: int = 512
    conc_output_len: int = 128
    max_model_len: int = 8192
    # 384 sequences of up to 2000 tokens fit the KV cache at 0.92 utilization (131 KB/token in
    # bf16), so random 1000x1000 decodes at a larger batch without preemption.
    max_num_seqs: int = 384
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.92
    async_scheduling: bool | None = None  # None: the engine's default (on for CUDA)
    decode_overlap_min_batch: int = 0  # the engine's default: off
    cuda_graph_max_batch: int = 512  # the engine's default
    # An fp8 KV cache holds twice the tokens: random 1000x1000 then decodes 768 sequences at once
    # (112,733 blocks of 16 = 900 sequences of 2000 tokens at 0.92), all replayed from graphs.
    fp8_kv_max_num_seqs: int = 768
    quantization: str = "none"  # "fp8": W8A8, "int8": weight-only (the goals: bf16)
    piecewise_graph_max_tokens: int = 512  # the engine's default; 0: steps with prompts eager

    @classmethod
    def small(cls, model: str) -> SuiteSizes:
        return cls(model=model, latency_batches=(1, 4), latency_input_len=32,
                   latency_output_len=8, ttft_input_len=64, ttft_repeats=1,
                   tput_num_prompts=8, tput_input_len=16, tput_output_len=8,
                   conc_num_prompts=4, conc_input_len=16, conc_output_len=8,
                   max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256,
                   fp8_kv_max_num_seqs=16)


# Per-step deadlines in seconds (the outer `timeout` in run_h200.sh is the last guard).
STEP_LIMITS_S: dict[str, float] = {
    "latency_eager": 120, "latency_graphs": 150, "ttft_4096": 60,
    "throughput_random": 180, "concurrent_128": 60, "hf_baseline_128": 120,
    "throughput_random_fp8": 180, "throughput_random_int8": 180,
    "throughput_random_w8a8_fp8": 180,
}
# Run only when named in --steps (not part of the default run).
STEPS = tuple(STEP_LIMITS_S)


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise StepTimeout(f"step ran past its {seconds:g} s limit")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class EngineHolder:
    """Keeps at most one engine alive (two 8B instances do not fit with their KV caches)."""

    def __init__(self, sizes: SuiteSizes) -> None:
        self._sizes = sizes
        self._llm: Any = None
        self._key: tuple[bool, str, str] | None = None

    def get(self, enforce_eager: bool, kv_cache_dtype: str = "auto",
            quantization: str | None = None) -> Any:
        """The engine for these settings (`quantization` None: the suite's --quantization)."""
        quantization = self._sizes.quantization if quantization is None else quantization
        key = (enforce_eager, kv_cache_dtype, quantization)
        if self._llm is None or self._key != key:
            self.release()
            s = self._sizes
            one_byte_kv = kv_cache_dtype in ("fp8", "int8")  # twice the sequences fit
            max_num_seqs = s.fp8_kv_max_num_seqs if one_byte_kv else s.max_num_seqs
            graph_max = max(s.cuda_graph_max_batch, max_num_seqs) if one_byte_kv else \
                s.cuda_graph_max_batch
            settings = offline.EngineSettings(
                model=s.model, dtype="bfloat16", max_model_len=s.max_model_len,
                enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=s.max_num_batched_tokens,
                gpu_memory_utilization=s.gpu_memory_utilization, kv_cache_dtype=kv_cache_dtype,
                async_scheduling=s.async_scheduling,
                decode_overlap_min_batch=s.decode_overlap_min_batch,
                cuda_graph_max_batch=graph_max,
                piecewise_graph_max_tokens=s.piecewise_graph_max_tokens,
                quantization=quantization)
            self._llm = offline.build_llm(settings)
            self._key = key
        return self._llm

    @property
    def quantization(self) -> str | None:
        """The live engine's weight quantization (None without an engine)."""
        return self._key[2] if self._key is not None else None

    def release(self) -> None:
        """Drop the engine and give its GPU memory back (after a failure, or before HF)."""
        if self._llm is not None:
            shutdown = getattr(self._llm, "shutdown", None)
            if callable(shutdown):
                shutdown()
        self._llm, self._key = None, None
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass


def _latency(holder: EngineHolder, s: SuiteSizes, vocab: int, eager: bool) -> dict[str, Any]:
    llm = holder.get(enforce_eager=eager)
    return {f"bs{b}": dataclasses.asdict(offline.run_latency(
        llm, b, s.latency_input_len, s.latency_output_len, vocab, seed=b))
        for b in s.latency_batches}


def _ttft(holder: EngineHolder, s: SuiteSizes, vocab: int) -> dict[str, Any]:
    llm = holder.get(enforce_eager=False)
    # Distinct seeds: a repeated prompt would hit the prefix cache and skip the prefill.
    runs = [offline.run_latency(llm, 1, s.ttft_input_len, 1, vocab, seed=100 + i)
            for i in range(s.ttft_repeats)]
    ttfts = [r.median_ttft_ms for r in runs]
    return {"input_len": s.ttft_input_len, "ttft_ms_runs": ttfts,
            "median_ttft_ms": statistics.median(ttfts)}


def _throughput(holder: EngineHolder, vocab: int, n: int, i: int, o: int,
                kv_cache_dtype: str = "auto", quantization: str | None = None
                ) -> dict[str, Any]:
    llm = holder.get(enforce_eager=False, kv_cache_dtype=kv_cache_dtype,
                     quantization=quantization)
    requests = random_requests(n, i, o, vocab, seed=7)
    records, duration = offline.run_throughput(llm, requests)
    metrics = compute_metrics(records, duration, percentiles=(50.0, 99.0))
    engine = getattr(llm, "engine", None)
    extra = {} if engine is None else {
        "num_preemptions_total": engine.scheduler.num_preemptions,
        "num_kv_blocks": engine.kv.num_blocks,
        "cuda_graph_replays_total": getattr(engine.runner.graphs, "num_replays", None),
        "overlapped_decode_steps_total": getattr(engine.runner, "num_overlapped_steps", None)}
    return {"num_prompts": n, "input_len": i, "output_len": o, "kv_cache_dtype": kv_cache_dtype,
            "quantization": holder.quantization, **metrics.to_dict(), **extra}


def _hf(holder: EngineHolder, s: SuiteSizes) -> dict[str, Any]:
    import torch

    from bench.hf_baseline import build_model, run_generate

    holder.release()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = build_model(s.model, device, "bfloat16")
    try:
        return dataclasses.asdict(run_generate(hf, s.conc_num_prompts, s.conc_input_len,
                                               s.conc_output_len))
    finally:
        del hf
        gc.collect()


def build_steps(holder: EngineHolder, s: SuiteSizes) -> dict[str, Callable[[], dict[str, Any]]]:
    vocab = models.vocab_size_for(s.model)
    return {
        "latency_eager": lambda: _latency(holder, s, vocab, eager=True),
        "latency_graphs": lambda: _latency(holder, s, vocab, eager=False),
        "ttft_4096": lambda: _ttft(holder, s, vocab),
        "throughput_random": lambda: _throughput(holder, vocab, s.tput_num_prompts,
                                                 s.tput_input_len, s.tput_output_len),
        "concurrent_128": lambda: _throughput(holder, vocab, s.conc_num_prompts,
                                              s.conc_input_len, s.conc_output_len),
        "hf_baseline_128": lambda: _hf(holder, s),
        "throughput_random_fp8": lambda: _throughput(holder, vocab, s.tput_num_prompts,
                                                     s.tput_input_len, s.tput_output_len,
                                                     kv_cache_dtype="fp8"),
        "throughput_random_int8": lambda: _throughput(holder, vocab, s.tput_num_prompts,
                                                      s.tput_input_len, s.tput_output_len,
                                                      kv_cache_dtype="int8"),
        # Not the configuration (bf16 weights): fp8 W8A8 weights with an fp8 cache.
        "throughput_random_w8a8_fp8": lambda: _throughput(holder, vocab, s.tput_num_prompts,
                                                          s.tput_input_len, s.tput_output_len,
                                                          kv_cache_dtype="fp8",
                                                          quantization="fp8"),
    }


def run_suite(out_dir: Path, sizes: SuiteSizes, steps: tuple[str, ...],
              limit_scale: float = 1.0) -> dict[str, Any]:
    """Run `steps` in order; returns (and keeps writing) the suite document."""
    doc: dict[str, Any] = {"environment": environment_info(),
                           "sizes": dataclasses.asdict(sizes), "steps": {}}
    path = out_dir / "suite.json"
    write_json(path, doc)
    holder = EngineHolder(sizes)
    table = build_steps(holder, sizes)
    for name in steps:
        start = time.perf_counter()
        print(f"[suite] {name} ...", flush=True)
        try:
            with deadline(STEP_LIMITS_S[name] * limit_scale):
                entry: dict[str, Any] = {"ok": True, "result": table[name]()}
        except (Exception, StepTimeout) as e:
            entry = {"ok": False, "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc(limit=-8)}
            holder.release()  # an interrupted engine may hold requests: start clean next time
        entry["wall_s"] = round(time.perf_counter() - start, 2)
        doc["steps"][name] = entry
        write_json(path, doc)
        print(f"[suite] {name}: {'ok' if entry['ok'] else entry['error']} "
              f"({entry['wall_s']} s)", flush=True)
    holder.release()
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--small", action="store_true", help="tiny shapes (smoke test)")
    p.add_argument("--steps", default=",".join(STEPS),
                   help=f"comma list from {STEPS}")
    p.add_argument("--limit-scale", type=float, default=1.0, help="multiply every step limit")
    p.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                   help="the engine's async scheduling (auto: its default, on for CUDA)")
    p.add_argument("--decode-overlap-min-batch", type=int, default=0,
                   help="the engine's decode micro-batch overlap threshold (0, the default: off)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="override the suite's 384")
    p.add_argument("--fp8-kv-max-num-seqs", type=int, default=None,
                   help="override the fp8-KV throughput step's 768")
    p.add_argument("--cuda-graph-max-batch", type=int, default=512,
                   help="largest decode batch captured in a CUDA graph (the engine's default: 512)")
    p.add_argument("--quantization", default="none", choices=["none", "fp8", "int8"],
                   help="fp8: W8A8 weights and activations; int8: weight-only")
    p.add_argument("--piecewise-graph-max-tokens", type=int, default=512,
                   help="the engine's piecewise graphs (its default: 512; 0: off)")
    args = p.parse_args(argv)
    steps = tuple(x for x in args.steps.split(",") if x)
    unknown = [x for x in steps if x not in STEP_LIMITS_S]
    if unknown:
        p.error(f"--steps: unknown {unknown}; allowed: {', '.join(STEP_LIMITS_S)}")
    sizes = SuiteSizes.small(args.model) if args.small else SuiteSizes(model=args.model)
    sizes = dataclasses.replace(sizes, async_scheduling={"auto": None, "on": True, "off": False}[
        args.async_scheduling], decode_overlap_min_batch=args.decode_overlap_min_batch)
    if args.max_num_seqs is not None:
        sizes = dataclasses.replace(sizes, max_num_seqs=args.max_num_seqs)
    if args.fp8_kv_max_num_seqs is not None:
        sizes = dataclasses.replace(sizes, fp8_kv_max_num_seqs=args.fp8_kv_max_num_seqs)
    sizes = dataclasses.replace(sizes, quantization=args.quantization,
                                cuda_graph_max_batch=args.cuda_graph_max_batch,
                                piecewise_graph_max_tokens=args.piecewise_graph_max_tokens)
    doc = run_suite(Path(args.out_dir), sizes, steps, args.limit_scale)
    return 0 if all(e["ok"] for e in doc["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
