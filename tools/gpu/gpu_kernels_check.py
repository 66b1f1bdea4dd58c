"""Check every Triton kernel against its torch reference on real shapes, and time it.

Run on the GPU machine (Llama-3.1-8B shapes: H=32, Hkv=8, D=128, block_size 16, bf16):

    python3 tools/gpu/gpu_kernels_check.py --out $OUT/kernels.json

Prove the code paths on a CPU (Triton interpreter, tiny shapes, one timed call each):

    python3 tools/gpu/gpu_kernels_check.py --dry-run --out /tmp/kernels.json

For each check it records max abs error, relative error ||out - ref|| / ||ref|| (in float64),
whether every element of a NaN-poisoned output was written, and the median time from
`triton.testing.do_bench`; plus GB/s for memory-bound kernels and TFLOP/s for prefill, which is
also timed against torch SDPA's flash kernel (4-D tensors, KV heads repeated). The JSON is
rewritten after every check, so a partial run still leaves its results. Exit status 1 if any
check failed or raised.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402  (after the sys.path fix, before any Triton import)

from tools.profiling import graph_replay_ms  # noqa: E402


@dataclass(frozen=True, slots=True)
class Shapes:
    """Problem sizes of one run (real model shapes, or tiny ones for --dry-run)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    hidden: int
    intermediate: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_len: int
    varlen_q_lens: tuple[int, ...]
    varlen_prefixes: tuple[int, ...]
    elementwise_tokens: int
    vocab: int = 128256  # score_rows: a slice of prompt scoring's logits


REAL = Shapes(
    num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, hidden=4096, intermediate=14336,
    decode_batches=(1, 8, 64, 256), decode_contexts=(1024, 4096, 8192),
    prefill_len=4096,
    # chunked prefill / prefix-cache hits of several lengths, and two decode rows mixed in
    varlen_q_lens=(1024, 512, 2048, 300, 1, 777, 1, 1536),
    varlen_prefixes=(0, 3072, 2048, 100, 5000, 1000, 63, 512),
    elementwise_tokens=4096,
)
# Gemma-2-9B's attention (head_dim 256; its local layers' 4,096-position window, scores capped
# at 50): the `window` part's shapes.
GEMMA2 = Shapes(
    num_heads=16, num_kv_heads=8, head_dim=256, block_size=16, hidden=3584, intermediate=14336,
    decode_batches=(1, 64), decode_contexts=(8192,), prefill_len=8192,
    varlen_q_lens=(2048, 1, 512, 1), varlen_prefixes=(4096, 6000, 3000, 100),
    elementwise_tokens=4096, vocab=256000,
)
TINY = Shapes(
    num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, hidden=64, intermediate=96,
    decode_batches=(1, 3), decode_contexts=(40,),
    prefill_len=40,
    varlen_q_lens=(17, 1, 9),
    varlen_prefixes=(0, 30, 12),
    elementwise_tokens=8,
    vocab=1000,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file to write (default: print to stdout only)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU + TRITON_INTERPRET=1, tiny shapes, one timed call per kernel")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up (ms)")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time (ms)")
    parser.add_argument("--only", default="",
                        help="comma-separated subset of: decode,prefill,elementwise,graph,gemv,fp8,"
                             "int8kv,int8,verify,w8a8,window")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- measuring


class Timer:
    """Median kernel time in ms: `do_bench` on CUDA, one perf_counter call in --dry-run."""

    def __init__(self, device: torch.device, warmup_ms: int, rep_ms: int) -> None:
        self.device = device
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.device.type != "cuda":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"))


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """Max abs error, relative L2 error (float64) and whether out is all finite."""
    o, r = out.double(), ref.double()
    diff = o - r
    ref_norm = r.norm().item()
    return {
        "max_abs_err": diff.abs().max().item() if diff.numel() else 0.0,
        "rel_err": diff.norm().item() / ref_norm if ref_norm > 0 else diff.norm().item(),
        "all_finite": bool(torch.isfinite(o).all().item()),
    }


# Quantized KV checks: fp8 K stored divided by 0.5, V by 0.25; int8 K by 0.04, V by 0.03 (N(0, 1)
# values reach ~5: 127 steps cover them). The reference reads the same stored values, so only the
# kernel's arithmetic (fp16 dots, online softmax) differs from it.
FP8_SCALES = (0.5, 0.25)
INT8_KV_SCALES = (0.04, 0.03)
FP8_TOLERANCE = 3e-2
QUANT_KV_SCALES = {torch.float8_e4m3fn: FP8_SCALES, torch.int8: INT8_KV_SCALES}


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]


def verdict(result: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    result["ok"] = bool(result["all_finite"] and result["rel_err"] < tolerance(dtype))
    return result


# ----------------------------------------------------------------------------- inputs


def make_cache(
    num_blocks: int, s: Shapes, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    shape = (2, num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def shuffled_block_tables(
    seq_lens: list[int], block_size: int, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Disjoint, randomly permuted blocks per sequence; returns (block_tables, num_blocks).

    `gen` is a CPU generator (the permutation is drawn on the host).
    """
    per_seq = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    num_blocks = sum(per_seq) + 1
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros((len(seq_lens), max(per_seq)), dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[used:used + n]
        used += n
    return table.to(device), num_blocks


@dataclass(frozen=True, slots=True)
class VarlenBatch:
    """One prefill check's inputs (see `Checker.varlen_batch`)."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    out: torch.Tensor
    flops: float


# ----------------------------------------------------------------------------- checks


class Checker:
    """Runs the checks and accumulates results into one JSON document."""

    def __init__(self, args: argparse.Namespace, shapes: Shapes, device: torch.device) -> None:
        self.args = args
        self.s = shapes
        self.device = device
        self.dtype: torch.dtype = getattr(torch, args.dtype)
        self.gen = torch.Generator(device=device).manual_seed(args.seed)
        self.cpu_gen = torch.Generator(device="cpu").manual_seed(args.seed)  # host-side perms
        self.timer = Timer(device, args.warmup_ms, args.rep_ms)
        self.results: list[dict[str, Any]] = []
        self.doc: dict[str, Any] = {"meta": meta(args, shapes, device), "results": self.results}

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        start = time.perf_counter()
        try:
            result = {"check": name, **fn()}
        except Exception as exc:  # one failing check must not lose the others
            result = {"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(limit=8)}
        result["wall_s"] = round(time.perf_counter() - start, 3)
        self.results.append(result)
        print(json.dumps(compact(result)), flush=True)
        self.write()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def write(self) -> None:
        self.doc["ok"] = all(r.get("ok", False) for r in self.results)
        if self.args.out is not None:
            self.args.out.parent.mkdir(parents=True, exist_ok=True)
            self.args.out.write_text(json.dumps(self.doc, indent=2) + "\n")

    def randn(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = torch.randn(shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return t.to(dtype or self.dtype)

    # -- decode ------------------------------------------------------------------------

    def decode(self, batch: int, context: int, varlen: bool) -> dict[str, Any]:
        from engine.kernels import choose_num_splits, paged_decode_attention
        from engine.kernels.reference import paged_decode_attention_ref

        s = self.s
        if varlen:
            lens = torch.randint(1, context + 1, (batch,), generator=self.gen, device=self.device)
            seq_lens_list = [int(x) for x in lens.tolist()]
        else:
            seq_lens_list = [context] * batch
        block_tables, num_blocks = shuffled_block_tables(
            seq_lens_list, s.block_size, self.device, self.cpu_gen)
        kv_cache = make_cache(num_blocks, s, self.dtype, self.device, self.gen)
        seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=self.device)
        q = self.randn(batch, s.num_heads, s.head_dim)
        scale = s.head_dim ** -0.5
        splits = choose_num_splits(batch, s.num_kv_heads, context,
                                   _num_sms(self.device))
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, out=out,
                               max_seq_len=context)
        ref = paged_decode_attention_ref(q, kv_cache, block_tables, seq_lens, scale)
        result = verdict({"batch": batch, "context": context, "varlen": varlen,
                          "num_splits": splits, **errors(out, ref)}, self.dtype)
        kv_bytes = sum(seq_lens_list) * s.num_kv_heads * s.head_dim * 2 * kv_cache.element_size()
        timings: dict[str, float] = {}
        for n in sorted({splits, 1}):

            def call(n: int = n) -> None:
                paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, out=out,
                                       num_splits=n)

            timings[str(n)] = self.timer(call)
        result["ms_by_num_splits"] = timings
        result["ms"] = timings[str(splits)]
        result["kv_bytes"] = kv_bytes
        result["gb_per_s"] = kv_bytes / (result["ms"] * 1e-3) / 1e9
        if self.device.type == "cuda":  # as the runner will call it: no launch overhead
            graph_ms = self.graph_ms(lambda: paged_decode_attention(
                q, kv_cache, block_tables, seq_lens, scale, out=out, max_seq_len=context))
            result["graph_ms"] = graph_ms
            result["graph_gb_per_s"] = kv_bytes / (graph_ms * 1e-3) / 1e9
        return result

    def graph_ms(self, fn: Callable[[], object]) -> float:
        """Median replay time of `fn` captured in a CUDA graph (warmed up on a side stream)."""
        return graph_replay_ms(fn, self.timer)

    def decode_forced_splits(self) -> dict[str, Any]:
        """Split-K with many splits on uneven lengths (every path through the reduce)."""
        from engine.kernels import paged_decode_attention
        from engine.kernels.reference import paged_decode_attention_ref

        s = self.s
        seq_lens_list = [1, 2, s.block_size, s.block_size + 1, 3 * s.block_size + 5, 40]
        block_tables, num_blocks = shuffled_block_tables(
            seq_lens_list, s.block_size, self.device, self.cpu_gen)
        kv_cache = make_cache(num_blocks, s, self.dtype, self.device, self.gen)
        seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=self.device)
        q = self.randn(len(seq_lens_list), s.num_heads, s.head_dim)
        ref = paged_decode_attention_ref(q, kv_cache, block_tables, seq_lens, 0.1)
        worst: dict[str, Any] = {"rel_err": 0.0, "all_finite": True, "max_abs_err": 0.0}
        for n in (1, 2, 3, 7, 16):
            out = torch.full_like(q, float("nan"))
            paged_decode_attention(q, kv_cache, block_tables, seq_lens, 0.1, out=out,
                                   num_splits=n)
            e = errors(out, ref)
            worst = {k: (max(worst[k], e[k]) if k != "all_finite" else worst[k] and e[k])
                     for k in worst}
        return verdict({"seq_lens": seq_lens_list, **worst}, self.dtype)

    def decode_graph(self) -> dict[str, Any]:
        """Capture decode in a CUDA graph, change seq_lens/q in place, replay, compare."""
        from engine.kernels import paged_decode_attention
        from engine.kernels.reference import paged_decode_attention_ref

        s = self.s
        batch, context = 8, 4096
        block_tables, num_blocks = shuffled_block_tables(
            [context] * batch, s.block_size, self.device, self.cpu_gen)
        kv_cache = make_cache(num_blocks, s, self.dtype, self.device, self.gen)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=self.device)
        q = self.randn(batch, s.num_heads, s.head_dim)
        out = torch.empty_like(q)
        scale = s.head_dim ** -0.5

        def step() -> None:
            paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, out=out,
                                   max_seq_len=context)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        new_lens = torch.randint(1, context + 1, (batch,), generator=self.gen,
                                 device=self.device).to(torch.int32)
        seq_lens.copy_(new_lens)
        q.copy_(self.randn(batch, s.num_heads, s.head_dim))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_decode_attention_ref(q, kv_cache, block_tables, seq_lens, scale)
        result = verdict({"batch": batch, "context": context, **errors(out, ref)}, self.dtype)
        result["graph_replay_ms"] = self.timer(graph.replay)
        return result

    def verify(self, batch: int, context: int, query_len: int) -> dict[str, Any]:
        """A speculative verify step's attention: `query_len` tokens per sequence at the end of
        `context` positions, through the split decode kernel (`query_len=`) and through the
        paged prefill kernel (what verify steps used before), against the reference."""
        from engine.kernels import paged_decode_attention, paged_prefill_attention
        from engine.kernels.reference import paged_attention_ref

        q_lens = [query_len] * batch
        b = self.varlen_batch(q_lens, [context - query_len] * batch,
                              lambda num_blocks: make_cache(num_blocks, self.s, self.dtype,
                                                            self.device, self.gen))
        paged_decode_attention(b.q, b.kv_cache, b.block_tables, b.seq_lens, b.scale, out=b.out,
                               max_seq_len=context, query_len=query_len)
        ref = paged_attention_ref(b.q, b.kv_cache, b.qsl, b.seq_lens, b.block_tables, b.scale)
        result = verdict({"batch": batch, "context": context, "query_len": query_len,
                          **errors(b.out, ref)}, self.dtype)
        del ref
        result["decode_kernel_ms"] = self.timer(lambda: paged_decode_attention(
            b.q, b.kv_cache, b.block_tables, b.seq_lens, b.scale, out=b.out,
            max_seq_len=context, query_len=query_len))
        result["prefill_kernel_ms"] = self.timer(lambda: paged_prefill_attention(
            b.q, b.kv_cache, b.qsl, b.seq_lens, b.block_tables, b.scale, query_len, out=b.out))
        kv_bytes = (batch * context * self.s.num_kv_heads * self.s.head_dim * 2
                    * b.kv_cache.element_size())
        result["decode_kernel_gb_per_s"] = kv_bytes / (result["decode_kernel_ms"] * 1e-3) / 1e9
        return result

    def windowed(self, q_lens: list[int], prefixes: list[int], window: int, softcap: float
                 ) -> dict[str, Any]:
        """Sliding-window, soft-capped attention (a Gemma 2 local layer) against the reference:
        all single-token rows through the split decode kernel, uniform multi-token rows through
        it as a verify step, anything else through the paged prefill kernel; timed, with the
        bytes a windowed decode reads (at most `window` positions a sequence)."""
        from engine.kernels import paged_decode_attention, paged_prefill_attention
        from engine.kernels.reference import paged_attention_ref

        b = self.varlen_batch(q_lens, prefixes, lambda num_blocks: make_cache(
            num_blocks, self.s, self.dtype, self.device, self.gen))
        uniform = len(set(q_lens)) == 1
        kernel = "decode" if uniform else "prefill"

        def call() -> None:
            if uniform:
                paged_decode_attention(b.q, b.kv_cache, b.block_tables, b.seq_lens, b.scale,
                                       out=b.out, query_len=q_lens[0], sliding_window=window,
                                       logit_softcap=softcap)
            else:
                paged_prefill_attention(b.q, b.kv_cache, b.qsl, b.seq_lens, b.block_tables,
                                        b.scale, max(q_lens), out=b.out, sliding_window=window,
                                        logit_softcap=softcap)

        call()
        ref = paged_attention_ref(b.q, b.kv_cache, b.qsl, b.seq_lens, b.block_tables, b.scale,
                                  sliding_window=window, logit_softcap=softcap)
        result = verdict({"kernel": kernel, "q_lens": q_lens[:8], "batch": len(q_lens),
                          "prefixes": prefixes[:8], "sliding_window": window,
                          "logit_softcap": softcap, **errors(b.out, ref)}, self.dtype)
        del ref
        result["ms"] = self.timer(call)
        if uniform:
            seen = sum(min(p + n, window + n - 1) for p, n in zip(prefixes, q_lens, strict=True))
            kv_bytes = seen * self.s.num_kv_heads * self.s.head_dim * 2 * b.kv_cache.element_size()
            result["gb_per_s"] = kv_bytes / (result["ms"] * 1e-3) / 1e9
        return result

    # -- prefill -----------------------------------------------------------------------

    def prefill(self, q_lens: list[int], prefixes: list[int], sdpa: bool) -> dict[str, Any]:
        from engine.kernels import paged_prefill_attention
        from engine.kernels.reference import paged_attention_ref

        b = self.varlen_batch(q_lens, prefixes, lambda num_blocks: make_cache(
            num_blocks, self.s, self.dtype, self.device, self.gen))
        max_q = max(q_lens)
        paged_prefill_attention(b.q, b.kv_cache, b.qsl, b.seq_lens, b.block_tables, b.scale,
                                max_q, out=b.out)
        ref = paged_attention_ref(b.q, b.kv_cache, b.qsl, b.seq_lens, b.block_tables, b.scale)
        result = verdict({"q_lens": q_lens, "prefixes": prefixes, **errors(b.out, ref)},
                         self.dtype)
        del ref
        ms = self.timer(lambda: paged_prefill_attention(
            b.q, b.kv_cache, b.qsl, b.seq_lens, b.block_tables, b.scale, max_q, out=b.out))
        result.update({"ms": ms, "tflop_per_s": b.flops / (ms * 1e-3) / 1e12})
        if sdpa:
            result["sdpa"] = self.sdpa_baseline(b.q, b.kv_cache, b.block_tables,
                                                prefixes[0] + q_lens[0], b.scale, b.out, b.flops)
        return result

    def varlen_batch(self, q_lens: list[int], prefixes: list[int],
                     make_kv: Callable[[int], torch.Tensor]) -> VarlenBatch:
        """Queries of sequences with `prefixes[i]` cached tokens and `q_lens[i]` new ones over
        shuffled blocks of a cache from `make_kv(num_blocks)`; a NaN-filled output."""
        s = self.s
        lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
        block_tables, num_blocks = shuffled_block_tables(lens, s.block_size, self.device,
                                                         self.cpu_gen)
        kv_cache = make_kv(num_blocks)
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        q = self.randn(starts[-1], s.num_heads, s.head_dim)
        # causal: query i of a sequence sees prefix + i + 1 keys; 2 matmuls x 2 flop per MAC
        visible = sum(n * p + n * (n + 1) // 2 for p, n in zip(prefixes, q_lens, strict=True))
        return VarlenBatch(
            q=q, kv_cache=kv_cache, block_tables=block_tables,
            qsl=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            scale=s.head_dim ** -0.5, out=torch.full_like(q, float("nan")),
            flops=4.0 * s.num_heads * s.head_dim * visible)

    def sdpa_baseline(
        self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
        seq_len: int, scale: float, triton_out: torch.Tensor, flops: float,
    ) -> dict[str, Any]:
        """torch SDPA on 4-D tensors with KV heads repeated (single sequence, no prefix)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from engine.kernels.reference import gather_kv_ref

        group = self.s.num_heads // self.s.num_kv_heads
        k, v = gather_kv_ref(kv_cache, block_tables[0], seq_len)  # [S, Hkv, D]
        q4 = q.transpose(0, 1).unsqueeze(0)  # [1, H, S, D]
        k4 = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
        v4 = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
        q4 = q4.contiguous()
        backends = [SDPBackend.FLASH_ATTENTION] if self.device.type == "cuda" else \
            [SDPBackend.MATH]

        def call() -> torch.Tensor:
            with sdpa_kernel(backends):
                return torch.nn.functional.scaled_dot_product_attention(
                    q4, k4, v4, is_causal=True, scale=scale)

        sdpa_out = call()[0].transpose(0, 1)  # [S, H, D]
        ms = self.timer(call)
        return {"backend": str(backends[0]), "ms": ms,
                "tflop_per_s": flops / (ms * 1e-3) / 1e12,
                "rel_err_vs_triton": errors(triton_out, sdpa_out)["rel_err"]}

    # -- elementwise -------------------------------------------------------------------

    def rms_norm(self, with_residual: bool) -> dict[str, Any]:
        from engine.kernels import rms_norm
        from engine.kernels.reference import rms_norm_ref

        t, n = self.s.elementwise_tokens, self.s.hidden
        x, w = self.randn(t, n), self.randn(n)
        res = self.randn(t, n) if with_residual else None
        got = rms_norm(x, w, 1e-5, res)
        want = rms_norm_ref(x, w, 1e-5, res)
        if isinstance(got, tuple) and isinstance(want, tuple):
            e, e2 = errors(got[0], want[0]), errors(got[1], want[1])
            e = {"max_abs_err": max(e["max_abs_err"], e2["max_abs_err"]),
                 "rel_err": max(e["rel_err"], e2["rel_err"]),
                 "all_finite": e["all_finite"] and e2["all_finite"]}
        else:
            assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
            e = errors(got, want)
        result = verdict({"tokens": t, "hidden": n, "residual": with_residual, **e}, self.dtype)
        moved = x.numel() * x.element_size() * (4 if with_residual else 2)
        return self.timed(result, lambda: rms_norm(x, w, 1e-5, res),
                          lambda: rms_norm_ref(x, w, 1e-5, res), moved)

    def gemma_norm(self) -> dict[str, Any]:
        """Gemma's norm (weight 1 + w kept in float32, `round_before_weight=False`) of bf16 rows
        against transformers' formula (float32 throughout, one rounding at the end): elements
        that differ come only from the two sums of squares' orders (a bf16 step at most, rare);
        Llama's order (x / rms(x) rounded first) differs in a large share."""
        from engine.kernels import rms_norm

        t, n = self.s.elementwise_tokens, 3584  # Gemma-2-9B's hidden size
        x = self.randn(t, n, dtype=torch.bfloat16)
        w = (0.3 * self.randn(n, dtype=torch.float32)).to(torch.bfloat16).float() + 1.0
        h = x.float()
        want = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(torch.bfloat16)
        once = rms_norm(x, w, 1e-6, round_before_weight=False)
        twice = rms_norm(x, w, 1e-6, round_before_weight=True)
        assert isinstance(once, torch.Tensor) and isinstance(twice, torch.Tensor)
        err = (once.float() - want.float()).abs()
        step = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(1e-3)
        differ, differ_twice = int((err > 0).sum()), int((twice != want).sum())
        if self.device.type == "cuda":
            ok = differ < want.numel() // 100 and differ * 10 < differ_twice
        else:  # the interpreter rounds float32 to bf16 toward zero: only closer on average
            ok = bool(err.mean() < 0.75 * (twice.float() - want.float()).abs().mean())
        ok = ok and bool((err <= step).all())
        return {"tokens": t, "hidden": n, "elements": want.numel(), "differ": differ,
                "differ_llama_order": differ_twice, "max_abs_err": float(err.max()), "ok": ok}

    def rotary(self) -> dict[str, Any]:
        from engine.kernels import rotary_embedding
        from engine.kernels.reference import rotary_embedding_ref

        s, t = self.s, self.s.elementwise_tokens
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        max_pos = 8192
        qkv = self.randn(t, q_size + 2 * kv_size)  # views with a padded token stride
        q = qkv[:, :q_size].view(t, s.num_heads, s.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(t, s.num_kv_heads, s.head_dim)
        positions = torch.randint(0, max_pos, (t,), generator=self.gen, device=self.device)
        cache = self.randn(max_pos, s.head_dim, dtype=torch.float32)
        q_ref, k_ref = q.clone(), k.clone()
        rotary_embedding(positions, q, k, cache)
        rotary_embedding_ref(positions, q_ref, k_ref, cache)
        e = errors(torch.cat([q.flatten(), k.flatten()]), torch.cat([q_ref.flatten(),
                                                                     k_ref.flatten()]))
        result = verdict({"tokens": t, **e}, self.dtype)
        moved = 2 * (q.numel() + k.numel()) * q.element_size()
        return self.timed(result, lambda: rotary_embedding(positions, q, k, cache),
                          lambda: rotary_embedding_ref(positions, q_ref, k_ref, cache), moved)

    def silu(self) -> dict[str, Any]:
        from engine.kernels import silu_and_mul
        from engine.kernels.reference import silu_and_mul_ref

        t, inter = self.s.elementwise_tokens, self.s.intermediate
        x = self.randn(t, 2 * inter)
        result = verdict({"tokens": t, "intermediate": inter,
                          **errors(silu_and_mul(x), silu_and_mul_ref(x))}, self.dtype)
        moved = x.numel() * x.element_size() * 3 // 2
        return self.timed(result, lambda: silu_and_mul(x), lambda: silu_and_mul_ref(x), moved)

    def score(self) -> dict[str, Any]:
        """Prompt scoring's kernel on one 512-row slice of logits (the engine's slice): logprobs
        and log-sum-exp against the reference, ranks and argmax exactly."""
        from engine.kernels import score_rows
        from engine.kernels.reference import score_rows_ref

        rows, vocab = min(512, self.s.elementwise_tokens), self.s.vocab
        logits = 4 * self.randn(rows, vocab)
        targets = torch.randint(0, vocab, (rows,), generator=self.gen, device=self.device)
        got, want = score_rows(logits, targets), score_rows_ref(logits, targets)
        result = {"rows": rows, "vocab": vocab, **errors(got[0], want[0]),
                  "lse_max_abs_err": (got[2] - want[2]).abs().max().item(),
                  "ranks_equal": bool(torch.equal(got[1], want[1])),
                  "argmax_equal": bool(torch.equal(got[3], want[3]))}
        verdict(result, torch.float32)  # fp32 math on both sides: the fp32 tolerance
        result["ok"] = bool(result["ok"] and result["ranks_equal"] and result["argmax_equal"])
        moved = logits.numel() * logits.element_size()
        return self.timed(result, lambda: score_rows(logits, targets),
                          lambda: score_rows_ref(logits, targets), moved)

    def write_kv(self) -> dict[str, Any]:
        from engine.kernels import write_kv
        from engine.kernels.reference import write_kv_ref

        s, t = self.s, self.s.elementwise_tokens
        num_blocks = 2 * math.ceil(t / s.block_size) + 1
        kv_cache = make_cache(num_blocks, s, self.dtype, self.device, self.gen)
        kv_ref = kv_cache.clone()
        perm = torch.randperm(num_blocks * s.block_size, generator=self.cpu_gen)
        slots = perm[:t].to(torch.int64)
        slots[::7] = -1  # padding tokens are skipped
        slot_mapping = slots.to(self.device)
        key, value = self.randn(t, s.num_kv_heads, s.head_dim), self.randn(
            t, s.num_kv_heads, s.head_dim)
        write_kv(key, value, kv_cache, slot_mapping)
        write_kv_ref(key, value, kv_ref, slot_mapping)
        result = verdict({"tokens": t, **errors(kv_cache, kv_ref),
                          "exact": bool(torch.equal(kv_cache, kv_ref))}, self.dtype)
        result["ok"] = result["ok"] and result["exact"]
        moved = 4 * key.numel() * key.element_size()
        return self.timed(result, lambda: write_kv(key, value, kv_cache, slot_mapping),
                          lambda: write_kv_ref(key, value, kv_ref, slot_mapping), moved)

    # -- batch-1 GEMV ---------------------------------------------------------------------

    def gemv(self, n: int, k: int, gated: bool) -> dict[str, Any]:
        """One-row matmul (fused with SiLU-and-mul when `gated`) vs torch in float32; timed
        against cuBLAS on the same bf16 operands (one weight: L2-resident for small ones)."""
        from engine.kernels.gemv import gemv, gemv_silu_and_mul

        x, w = self.randn(1, k), self.randn(2 * n if gated else n, k) * 0.02
        full = x.float() @ w.float().T
        if gated:
            want = torch.nn.functional.silu(full[:, :n]) * full[:, n:]
            got = gemv_silu_and_mul(x, w)
        else:
            want, got = full, gemv(x, w)
        result = verdict({"n": n, "k": k, "gated": gated, **errors(got, want.to(self.dtype))},
                         self.dtype)
        fn = (lambda: gemv_silu_and_mul(x, w)) if gated else (lambda: gemv(x, w))
        return self.timed(result, fn, lambda: torch.nn.functional.linear(x, w),
                          w.numel() * w.element_size())

    def w8a8_gemv(self, n: int, k: int) -> dict[str, Any]:
        """fp8 W8A8 at one row: the GEMV on the per-token quantized row and the e4m3 weight
        (what `Fp8Linear` runs at batch 1) vs the float32 product of the same quantized
        operands and vs `torch._scaled_mm` (its many-row path); timed against `_scaled_mm`."""
        from engine.kernels import per_token_quant_fp8
        from engine.kernels.gemv import gemv
        from engine.model.quant import quantize_weight_fp8

        q, scale = quantize_weight_fp8(self.randn(n, k) * 0.02)
        xq, x_scale = per_token_quant_fp8(self.randn(1, k))
        want = (xq.float() @ q.float().T) * x_scale * scale

        def fn() -> torch.Tensor:
            return gemv(xq, q, weight_scale=scale, x_scale=x_scale, out_dtype=self.dtype)

        def scaled_mm() -> torch.Tensor:
            return torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=scale[None, :],
                                    out_dtype=self.dtype)

        got, mm = fn(), scaled_mm()
        result = verdict({"n": n, "k": k, **errors(got, want.to(self.dtype)),
                          "rel_err_vs_scaled_mm": float((got.float() - mm.float()).norm()
                                                        / mm.float().norm())}, self.dtype)
        return self.timed(result, fn, scaled_mm, q.numel())

    # -- int8 weight-only -----------------------------------------------------------------

    def int8_linear(self, rows: int, n: int, k: int) -> dict[str, Any]:
        """int8 weights (per-row scale) times `rows` activations: the GEMV for one row, else
        `w8a16_linear` (the W8A16 matmul, or cuBLAS on the widened weight from
        `DEQUANT_MIN_ROWS`), vs the float32 product of the same int8 values; timed against
        cuBLAS on the bf16 weight it stands for. Also checks the widening bitwise."""
        from engine.kernels.gemv import gemv
        from engine.kernels.w8a16 import dequantize_int8, w8a16_linear
        from engine.model.quant import quantize_weight_int8

        w = self.randn(n, k) * 0.02
        q, scale = quantize_weight_int8(w)
        x = self.randn(rows, k)
        want = (x.float() @ q.float().T) * scale

        def fn() -> torch.Tensor:
            if rows == 1:
                return gemv(x, q, weight_scale=scale)
            return w8a16_linear(x, q, scale)

        widened_exact = bool(torch.equal(dequantize_int8(q, scale, self.dtype),
                                         (q.float() * scale[:, None]).to(self.dtype)))
        result = verdict({"rows": rows, "n": n, "k": k, "widened_exact": widened_exact,
                          **errors(fn(), want.to(self.dtype))}, self.dtype)
        result["ok"] = bool(result["ok"] and widened_exact)
        return self.timed(result, fn, lambda: torch.nn.functional.linear(x, w), q.numel())

    # -- quantized (fp8 / int8) KV cache ----------------------------------------------------

    def quant_cache(self, num_blocks: int, kv_dtype: torch.dtype = torch.float8_e4m3fn
                    ) -> torch.Tensor:
        """A cache of `kv_dtype` holding N(0, 1) K/V quantized with its QUANT_KV_SCALES."""
        from engine.kernels.reference import quantize_ref

        scales = QUANT_KV_SCALES[kv_dtype]
        cache = make_cache(num_blocks, self.s, torch.float32, self.device, self.gen)
        return torch.stack([quantize_ref(cache[i], scales[i], kv_dtype) for i in range(2)])

    def write_kv_quant(self, kv_dtype: torch.dtype = torch.float8_e4m3fn) -> dict[str, Any]:
        from engine.kernels import write_kv
        from engine.kernels.reference import write_kv_ref

        s, t = self.s, self.s.elementwise_tokens
        num_blocks = 2 * math.ceil(t / s.block_size) + 1
        kv_cache = self.quant_cache(num_blocks, kv_dtype)
        scales = QUANT_KV_SCALES[kv_dtype]
        kv_ref = kv_cache.clone()
        slots = torch.randperm(num_blocks * s.block_size, generator=self.cpu_gen)[:t]
        slots[::7] = -1
        slot_mapping = slots.to(torch.int64).to(self.device)
        key = self.randn(t, s.num_kv_heads, s.head_dim) * 300  # some saturate at 448 / 127
        value = self.randn(t, s.num_kv_heads, s.head_dim)
        ks, vs = (torch.tensor(x, device=self.device) for x in scales)  # tensors: no sync
        write_kv(key, value, kv_cache, slot_mapping, ks, vs)
        write_kv_ref(key, value, kv_ref, slot_mapping, *scales)
        same = kv_cache.view(torch.uint8) == kv_ref.view(torch.uint8)
        exact = bool(same.all())
        result = {"kv_dtype": str(kv_dtype), "tokens": t,
                  **errors(kv_cache.float(), kv_ref.float()), "exact": exact,
                  "mismatched": int((~same).sum().item())}
        # Bit-exact is the bar (both sides multiply by the float32 1 / scale); were the device's
        # reciprocal to differ in the last bit, an int8 value at a half could move one step:
        # counted here, and allowed only as rare one-step moves.
        if kv_dtype == torch.int8 and not exact:
            steps = (kv_cache.float() - kv_ref.float()).abs().max().item()
            result["ok"] = steps <= 1.0 and result["mismatched"] * 10000 <= same.numel()
        else:
            result["ok"] = exact
        moved = 2 * key.numel() * key.element_size() + 2 * key.numel()
        return self.timed(result, lambda: write_kv(key, value, kv_cache, slot_mapping, ks, vs),
                          lambda: write_kv_ref(key, value, kv_ref, slot_mapping, *scales),
                          moved)

    def decode_quant(self, batch: int, context: int,
                     kv_dtype: torch.dtype = torch.float8_e4m3fn) -> dict[str, Any]:
        """Quantized cache, q in the run dtype, scales as device tensors (as a captured graph
        would see them); reference = the torch reference over the dequantized cache."""
        from engine.kernels import choose_num_splits, paged_decode_attention
        from engine.kernels.reference import paged_decode_attention_ref

        s = self.s
        lens = [context] * batch
        block_tables, num_blocks = shuffled_block_tables(lens, s.block_size, self.device,
                                                         self.cpu_gen)
        kv_cache = self.quant_cache(num_blocks, kv_dtype)
        scales = QUANT_KV_SCALES[kv_dtype]
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=self.device)
        q = self.randn(batch, s.num_heads, s.head_dim)
        scale = s.head_dim ** -0.5
        ks, vs = (torch.tensor(x, device=self.device) for x in scales)
        out = torch.full_like(q, float("nan"))

        def call() -> None:
            paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, out=out,
                                   max_seq_len=context, k_scale=ks, v_scale=vs)

        call()
        ref = paged_decode_attention_ref(q, kv_cache, block_tables, seq_lens, scale, *scales)
        result = {"kv_dtype": str(kv_dtype), "batch": batch, "context": context,
                  "q_dtype": str(self.dtype),
                  "num_splits": choose_num_splits(batch, s.num_kv_heads, context,
                                                  _num_sms(self.device)), **errors(out, ref)}
        result["ok"] = bool(result["all_finite"] and result["rel_err"] < FP8_TOLERANCE)
        kv_bytes = batch * context * s.num_kv_heads * s.head_dim * 2  # one byte per element
        result.update({"ms": self.timer(call), "kv_bytes": kv_bytes})
        result["gb_per_s"] = kv_bytes / (result["ms"] * 1e-3) / 1e9
        if self.device.type == "cuda":
            graph_ms = self.graph_ms(call)
            result["graph_ms"] = graph_ms
            result["graph_gb_per_s"] = kv_bytes / (graph_ms * 1e-3) / 1e9
        return result

    def prefill_quant(self, q_lens: list[int], prefixes: list[int],
                      kv_dtype: torch.dtype = torch.float8_e4m3fn) -> dict[str, Any]:
        from engine.kernels import paged_prefill_attention
        from engine.kernels.reference import paged_attention_ref

        scales = QUANT_KV_SCALES[kv_dtype]
        b = self.varlen_batch(q_lens, prefixes, lambda n: self.quant_cache(n, kv_dtype))

        def call() -> None:
            paged_prefill_attention(b.q, b.kv_cache, b.qsl, b.seq_lens, b.block_tables, b.scale,
                                    max(q_lens), out=b.out, k_scale=scales[0],
                                    v_scale=scales[1])

        call()
        ref = paged_attention_ref(b.q, b.kv_cache, b.qsl, b.seq_lens, b.block_tables, b.scale,
                                  *scales)
        result = {"kv_dtype": str(kv_dtype), "q_lens": q_lens, "prefixes": prefixes,
                  **errors(b.out, ref)}
        result["ok"] = bool(result["all_finite"] and result["rel_err"] < FP8_TOLERANCE)
        del ref
        ms = self.timer(call)
        result.update({"ms": ms, "tflop_per_s": b.flops / (ms * 1e-3) / 1e12})
        return result

    def timed(self, result: dict[str, Any], fn: Callable[[], object],
              ref_fn: Callable[[], object], moved_bytes: int) -> dict[str, Any]:
        ms, ref_ms = self.timer(fn), self.timer(ref_fn)
        result.update({"ms": ms, "torch_ref_ms": ref_ms, "bytes": moved_bytes,
                       "gb_per_s": moved_bytes / (ms * 1e-3) / 1e9})
        return result


def _num_sms(device: torch.device) -> int:
    from engine.kernels.decode_attention import device_num_sms

    return device_num_sms(device)


def compact(result: dict[str, Any]) -> dict[str, Any]:
    """A one-line summary for the log (the JSON keeps everything)."""
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in result.items()
            if k != "traceback"}


def meta(args: argparse.Namespace, s: Shapes, device: torch.device) -> dict[str, Any]:
    import triton

    info: dict[str, Any] = {
        "dry_run": bool(args.dry_run), "dtype": args.dtype, "seed": args.seed,
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "host": platform.node(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shapes": {k: getattr(s, k) for k in s.__slots__},
        "commit": _git_commit(),
    }
    return info


def _git_commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10, check=False)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_all(checker: Checker, only: set[str]) -> None:
    s = checker.s

    def want(part: str) -> bool:
        return not only or part in only

    if want("elementwise"):
        checker.run("write_kv", checker.write_kv)
        checker.run("rms_norm", lambda: checker.rms_norm(False))
        checker.run("rms_norm_residual", lambda: checker.rms_norm(True))
        checker.run("rms_norm_gemma", checker.gemma_norm)
        checker.run("rotary_embedding", checker.rotary)
        checker.run("silu_and_mul", checker.silu)
        checker.run("score_rows", checker.score)
    if want("decode"):
        checker.run("decode_forced_splits", checker.decode_forced_splits)
        for batch in s.decode_batches:
            for context in s.decode_contexts:

                def one(b: int = batch, c: int = context) -> dict[str, Any]:
                    return checker.decode(b, c, varlen=False)

                checker.run(f"decode_b{batch}_ctx{context}", one)
        checker.run("decode_varlen", lambda: checker.decode(
            s.decode_batches[-1], s.decode_contexts[-1], varlen=True))
    if want("verify"):
        for batch in s.decode_batches[:3]:
            for context in s.decode_contexts[:2]:

                def one_verify(b: int = batch, c: int = context) -> dict[str, Any]:
                    return checker.verify(b, c, query_len=5)

                checker.run(f"verify_q5_b{batch}_ctx{context}", one_verify)
    if want("graph") and checker.device.type == "cuda":
        checker.run("decode_cuda_graph", checker.decode_graph)
    if want("prefill"):
        checker.run(f"prefill_single_{s.prefill_len}",
                    lambda: checker.prefill([s.prefill_len], [0], sdpa=True))
        checker.run("prefill_varlen_prefix", lambda: checker.prefill(
            list(s.varlen_q_lens), list(s.varlen_prefixes), sdpa=False))
    if want("gemv"):
        q_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        checker.run("gemv_qkv", lambda: checker.gemv(q_out, s.hidden, gated=False))
        checker.run("gemv_o", lambda: checker.gemv(s.hidden, s.num_heads * s.head_dim, False))
        checker.run("gemv_gate_up_silu", lambda: checker.gemv(s.intermediate, s.hidden, True))
        checker.run("gemv_down", lambda: checker.gemv(s.hidden, s.intermediate, gated=False))
    if want("w8a8"):
        qkv_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        for label, n, k in (("qkv", qkv_out, s.hidden), ("o", s.hidden, s.num_heads * s.head_dim),
                            ("gate_up", 2 * s.intermediate, s.hidden),
                            ("down", s.hidden, s.intermediate)):
            checker.run(f"w8a8_gemv_{label}", functools.partial(checker.w8a8_gemv, n, k))
    if want("int8"):
        qkv_out = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        for rows in (1, 8, 64, s.prefill_len):
            for label, n, k in (("down", s.hidden, s.intermediate), ("qkv", qkv_out, s.hidden)):

                def one_int8(r: int = rows, n_: int = n, k_: int = k) -> dict[str, Any]:
                    return checker.int8_linear(r, n_, k_)

                checker.run(f"int8_{label}_m{rows}", one_int8)
    if want("window"):
        run_windowed(checker)
    for part, kv_dtype in (("fp8", torch.float8_e4m3fn), ("int8kv", torch.int8)):
        if not want(part):
            continue
        checker.run(f"write_kv_{part}", functools.partial(checker.write_kv_quant, kv_dtype))
        for context in s.decode_contexts:
            checker.run(f"decode_{part}_b{s.decode_batches[-1]}_ctx{context}", functools.partial(
                checker.decode_quant, s.decode_batches[-1], context, kv_dtype))
        checker.run(f"prefill_{part}_varlen_prefix", functools.partial(
            checker.prefill_quant, list(s.varlen_q_lens), list(s.varlen_prefixes), kv_dtype))


def run_windowed(checker: Checker) -> None:
    """The `window` part: Gemma-2-9B-shaped attention (tiny shapes in --dry-run) with a sliding
    window and capped scores: decodes at a context twice the window, a verify step, a fresh
    prompt twice the window and a chunked prefill with decodes mixed in."""
    real = checker.device.type == "cuda"
    saved, checker.s = checker.s, GEMMA2 if real else TINY
    window, cap = (4096, 50.0) if real else (24, 5.0)
    ctx = 2 * window
    s = checker.s
    try:
        for batch in s.decode_batches:
            checker.run(f"window_decode_b{batch}_ctx{ctx}", functools.partial(
                checker.windowed, [1] * batch, [ctx - 1] * batch, window, cap))
        checker.run(f"window_verify_q5_b8_ctx{ctx}", functools.partial(
            checker.windowed, [5] * 8, [ctx - 5] * 8, window, cap))
        checker.run(f"window_prefill_{ctx}", functools.partial(
            checker.windowed, [ctx, 1], [0, 3], window, cap))
        checker.run("window_prefill_varlen_prefix", functools.partial(
            checker.windowed, list(s.varlen_q_lens), list(s.varlen_prefixes), window, cap))
    finally:
        checker.s = saved


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        # Must precede the first Triton import (engine.kernels imports Triton lazily).
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
        shapes = TINY
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        shapes = REAL
    only = {p.strip() for p in args.only.split(",") if p.strip()}
    unknown = only - {"decode", "prefill", "elementwise", "graph", "gemv", "fp8", "int8kv", "int8",
                      "verify", "w8a8", "window"}
    if unknown:
        print(f"--only: unknown parts {sorted(unknown)}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    checker = Checker(args, shapes, device)
    run_all(checker, only)
    checker.write()
    failed = [r["check"] for r in checker.results if not r.get("ok", False)]
    print(json.dumps({"ok": not failed, "failed": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
