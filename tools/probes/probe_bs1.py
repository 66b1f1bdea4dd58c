"""Kernel-level probes behind the batch-1 ITL and 4096-token TTFT numbers (run on the H200).

1. Every matmul of a Llama-3.1-8B decode step at M=1 through cuBLAS vs a Triton GEMV sweep
   (32 distinct weight copies per shape, so L2 never holds them; CUDA-graph replays).
2. torch SDPA backends on the 4096-token causal prefill shape (the Triton kernel's tile sweep
   was this script's earlier `prefill` part: bench/results/h200/probe_bs1.json).
3. A graph-less batch-1 decode step's kernel table (1k context) from torch.profiler.
4. Host vs GPU time of one 4096-token prefill step through the engine.

Usage: PYTHONPATH=. python3 tools/probes/probe_bs1.py --out $OUT/probe.json [--parts gemv,sdpa,step,ttft]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from tools import profiling

LAYERS = 32
HIDDEN, INTER, Q, KV = 4096, 14336, 4096, 1024
SHAPES = {"qkv": (Q + 2 * KV, HIDDEN), "o": (HIDDEN, Q), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER)}


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + (k0 + cols)[None, :])
        x = tl.load(x_ptr + k0 + cols)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, 1).to(out_ptr.dtype.element_ty))


def graph_replay_ms(fn: Callable[[], None], reps: int = 20) -> float:
    """Median ms of one replay of a CUDA graph holding fn() (warmed up on a side stream)."""
    return profiling.graph_replay_ms(fn, functools.partial(median_event_ms, reps=reps))


def median_event_ms(call: Callable[[], object], reps: int) -> float:
    """Median of `reps` timings of `call` between two CUDA events, after one untimed call."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def _gemv_shape(n: int, k: int) -> dict[str, Any]:
    dev = torch.device("cuda")
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    gb = LAYERS * n * k * 2 / 1e9

    def cublas() -> None:
        for w in ws:
            torch.matmul(x, w.T, out=out)

    ms = graph_replay_ms(cublas)
    entry: dict[str, Any] = {"cublas_ms": ms, "cublas_tb_s": gb / ms}
    ref = torch.nn.functional.linear(x, ws[-1]).float()  # `out` ends holding the last layer's
    rows: list[dict[str, Any]] = []
    for bn, bk, warps, stages in itertools.product((8, 16, 32), (256, 512), (4, 8), (1, 3, 4)):
        if n % bn:
            continue

        def run(bn: int = bn, bk: int = bk, warps: int = warps, stages: int = stages) -> None:
            for w in ws:
                _gemv_kernel[(n // bn,)](x, w, out, n, k, BLOCK_N=bn, BLOCK_K=bk,
                                         num_warps=warps, num_stages=stages)
        try:
            run()
            err = (out.float() - ref).abs().max().item()
            t = graph_replay_ms(run)
        except Exception as e:  # a config that does not compile is recorded and skipped
            rows.append({"cfg": [bn, bk, warps, stages], "error": str(e)[:80]})
            continue
        rows.append({"cfg": [bn, bk, warps, stages], "ms": t, "tb_s": gb / t, "max_err": err})
    ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    entry["best"] = ok[0] if ok else None
    entry["triton"] = ok[:8]
    return entry


def probe_gemv() -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, (n, k) in SHAPES.items():
        res[name] = _gemv_shape(n, k)
        print(name, "cublas", round(res[name]["cublas_ms"], 3), "best", res[name]["best"],
              flush=True)
        torch.cuda.empty_cache()
    return res


def _event_ms(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def probe_sdpa() -> dict[str, Any]:
    """torch SDPA backends (GQA, causal) on the 4096-token prefill shape, [T, H, D] views."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    t, h, hkv, d = 4096, 32, 8, 128
    qkv = torch.randn(t, (h + 2 * hkv) * d, device=dev, dtype=torch.bfloat16)
    q = qkv[:, : h * d].view(t, h, d).transpose(0, 1)[None]
    k = qkv[:, h * d: (h + hkv) * d].view(t, hkv, d).transpose(0, 1)[None]
    v = qkv[:, (h + hkv) * d:].view(t, hkv, d).transpose(0, 1)[None]
    flops = 4 * t * t * d * h / 2
    res: dict[str, Any] = {}
    ref = None
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for gqa in (True, False):
            key = f"{name}_{'gqa' if gqa else 'repeat'}"
            try:
                kk, vv = (k, v) if gqa else (k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1))

                def fn(kk: torch.Tensor = kk, vv: torch.Tensor = vv, gqa: bool = gqa,
                       backend: Any = backend) -> torch.Tensor:
                    with sdpa_kernel([backend]):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, kk, vv, is_causal=True, enable_gqa=gqa)
                out = fn()
                if ref is None:
                    ref = out.float()
                err = (out.float() - ref).abs().max().item()
                ms = _event_ms(fn)
                res[key] = {"ms": ms, "tflops": flops / ms / 1e9, "max_err_vs_first": err}
            except Exception as e:  # an unsupported backend is recorded
                res[key] = {"error": str(e)[:160]}
    print("sdpa", res, flush=True)
    return res


def probe_ttft() -> dict[str, Any]:
    """Host vs GPU time of one 4096-token prefill step through the engine (CUDA graphs on)."""
    from engine import LLM, SamplingParams

    llm = LLM("dummy:llama-3.1-8b", dtype="bfloat16", max_model_len=8192, max_num_seqs=8,
              max_num_batched_tokens=8192, gpu_memory_utilization=0.5)
    eng = llm.engine
    rows = []
    for i in range(4):
        ids = [(i * 7919 + j * 31) % 120000 + 1 for j in range(4096)]
        eng.add_request(f"t{i}", ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = eng.scheduler.schedule()
        t_sched = time.perf_counter()
        eng.runner.prepare(out)  # timed alone (idempotent), then again inside execute
        torch.cuda.synchronize()
        prepare_ms = (time.perf_counter() - t_sched) * 1e3
        t1 = time.perf_counter()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        sampled = eng.runner.execute(out)
        b.record()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        eng.scheduler.update_from_output(out, sampled)
        t3 = time.perf_counter()
        # (Before 2026-11-29 schedule_ms was measured up to here, so it included prepare_ms:
        # bench/results/h200/probe_bs1*.json carry that sum.)
        rows.append({"schedule_ms": (t_sched - t0) * 1e3, "execute_ms": (t2 - t1) * 1e3,
                     "gpu_ms": a.elapsed_time(b), "update_ms": (t3 - t2) * 1e3, "prepare_ms": prepare_ms})
        while eng.has_unfinished_requests():
            eng.step()
    print("ttft", rows, flush=True)
    return {"rows": rows}


def probe_step() -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from engine import LLM, SamplingParams

    llm = LLM("dummy:llama-3.1-8b", dtype="bfloat16", max_model_len=8192, max_num_seqs=8,
              enforce_eager=True, gpu_memory_utilization=0.5)
    eng = llm.engine
    eng.add_request("p", list(range(1, 1025)), SamplingParams(temperature=0, max_tokens=10_000,
                                                              ignore_eos=True))
    for _ in range(8):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_time_total > 0:
            rows.append({"name": e.key[:60], "calls": e.count,
                         "us_per_step": e.device_time_total / 3, "us_avg": e.device_time_total / e.count})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    print("step kernels us", round(total, 1), rows[:12], flush=True)
    return {"kernel_us_per_step": total, "rows": rows[:30]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="gemv,sdpa,step,ttft")
    args = p.parse_args()
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name()}
    for part in args.parts.split(","):
        t = time.time()
        res[part] = {"gemv": probe_gemv, "step": probe_step,
                      "sdpa": probe_sdpa, "ttft": probe_ttft}[part]()
        res[part + "_s"] = time.time() - t
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
