"""Could decode attention run beside the matmuls on disjoint SMs? (run on the H200)

The offline throughput run is bound by decode attention (memory) plus the matmuls (compute), one
after the other (docs/performance.md, "What bounds random 1000x1000 now"). Two micro-batches on
two plain CUDA streams were slower (a35c1cd). This probe measures, for one Llama-3.1-8B decoder
layer at a decode batch B (default 768 sequences of 1.5k context), whether confining the
attention to some SMs with a CUDA green context lets the two overlap:

- `serial`: attention over B sequences, then the layer's four matmuls at M = B, one stream;
- `halves_serial`: the same work as two micro-batches of B/2, still one stream (what halving
  costs by itself: each matmul streams the weights twice);
- `halves_streams`: attention of half A beside the matmuls of half B, then the other way round,
  on two plain streams (the a35c1cd design);
- `halves_green_<S>`: the same with the attention on a green context of S SMs and the matmuls
  on the whole device (they get the SMs the attention does not hold);
- `halves_green2_<S>`: the matmuls on a second green context of the remaining SMs (with torch
  2.11's `GreenContext.create(num_sms=...)` the second context's SMs overlapped the first's,
  `shared_sms` in the output, so these were not disjoint partitions on the H200).

Every variant runs `--layers` layer-equivalents back to back and reports the median over
`--repeats` of the time between events that enclose all its work. Also measures each part
alone on its partition, and checks each green context's SMs with a kernel that reads %smid.

Usage: PYTHONPATH=. python3 tools/probes/probe_green_ctx.py --out F [--batch 768 --ctx 1536]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from bench.results import environment_info
from engine.kernels._checks import FP8_KV_DTYPE
from engine.kernels.decode_attention import paged_decode_attention
from tools.gpu.gpu_kernels_check import shuffled_block_tables

H, HKV, D, BS = 32, 8, 128, 16
HIDDEN, INTER = 4096, 14336
# One layer's projections as (in, out): fused QKV, O, fused gate/up, down.
PROJ = ((HIDDEN, (H + 2 * HKV) * D), (H * D, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN))


@triton.jit
def _smid_kernel(out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(out_ptr + offs)
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)
    tl.store(out_ptr + offs, smid)


def sm_set(stream: torch.cuda.Stream, programs: int = 1 << 15) -> list[int]:
    """The SM ids that a wide launch on `stream` ran on."""
    out = torch.zeros(programs * 128, dtype=torch.int32, device="cuda")
    with torch.cuda.stream(stream):
        _smid_kernel[(programs,)](out, BLOCK=128)
    stream.synchronize()
    return sorted(set(out.tolist()))


def green_stream(num_sms: int) -> tuple[Any, torch.cuda.Stream, str]:
    """A stream whose kernels run on a green context of `num_sms` SMs; (context, stream, how)."""
    from torch.cuda.green_contexts import GreenContext

    ctx: Any = GreenContext.create(num_sms=num_sms, device_id=torch.cuda.current_device())
    if hasattr(ctx, "Stream"):
        return ctx, ctx.Stream(), "GreenContext.Stream"
    # Older torch: make the context current and create a raw stream in it with the driver API.
    ctx.set_context()
    try:
        handle = ctypes.c_void_p()
        rc = ctypes.CDLL("libcuda.so.1").cuStreamCreate(ctypes.byref(handle), 1)  # non-blocking
        if rc != 0:
            raise RuntimeError(f"cuStreamCreate in the green context failed: {rc}")
    finally:
        ctx.pop_context()
    return ctx, torch.cuda.ExternalStream(handle.value), "set_context+cuStreamCreate"


class Layer:
    """One decoder layer's decode attention and matmuls, on B sequences of `ctx` tokens."""

    def __init__(self, batch: int, ctx: int, fp8: bool) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        dev = torch.device("cuda")
        self.tables, num_blocks = shuffled_block_tables([ctx] * batch, BS, dev,
                                                        torch.Generator().manual_seed(0))
        cache = torch.randn((2, num_blocks, BS, HKV, D), generator=gen, device=dev)
        self.cache = cache.to(FP8_KV_DTYPE if fp8 else torch.bfloat16)
        del cache
        self.scales = (0.5, 0.25) if fp8 else (None, None)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        self.q = torch.randn((batch, H, D), generator=gen, device=dev).to(torch.bfloat16)
        self.attn_out = torch.empty_like(self.q)
        self.ctx = ctx
        self.weights = [torch.randn((o, i), generator=gen, device=dev).to(torch.bfloat16) * 0.02
                        for i, o in PROJ]
        self.x = {i: torch.randn((batch, i), generator=gen, device=dev).to(torch.bfloat16)
                  for i, _ in PROJ}
        self.kv_bytes = batch * ctx * HKV * D * 2 * self.cache.element_size()

    def attention(self, lo: int, hi: int) -> None:
        paged_decode_attention(self.q[lo:hi], self.cache, self.tables[lo:hi],
                               self.seq_lens[lo:hi], D ** -0.5, out=self.attn_out[lo:hi],
                               max_seq_len=self.ctx, k_scale=self.scales[0],
                               v_scale=self.scales[1])

    def matmuls(self, lo: int, hi: int) -> None:
        for (i, _), w in zip(PROJ, self.weights, strict=True):
            torch.nn.functional.linear(self.x[i][lo:hi], w)


def timed(streams: list[torch.cuda.Stream], body: Callable[[], None], repeats: int) -> float:
    """Median ms of `body` (which enqueues on `streams`), fenced by events on the first one."""
    main = streams[0]
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record(main)
        for s in streams[1:]:
            s.wait_event(start)
        body()
        for s in streams[1:]:
            done = torch.cuda.Event()
            done.record(s)
            main.wait_event(done)
        end.record(main)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])  # the first is a warm-up


def barrier(a: torch.cuda.Stream, b: torch.cuda.Stream) -> None:
    ea, eb = torch.cuda.Event(), torch.cuda.Event()
    ea.record(a)
    eb.record(b)
    a.wait_event(eb)
    b.wait_event(ea)


def _repeat_on(stream: torch.cuda.Stream, fn: Callable[[], None], n: int) -> Callable[[], None]:
    def body() -> None:
        with torch.cuda.stream(stream):
            for _ in range(n):
                fn()
    return body


def probe_split(layer: Layer, attn_sms: int, matmul_sms: int, half: int, layers: int,
                repeats: int,
                halves: Callable[[torch.cuda.Stream, torch.cuda.Stream], Callable[[], None]]
                ) -> dict[str, Any]:
    """The attention on a green context of `attn_sms` SMs, the matmuls on the whole device and
    on a second green context of `matmul_sms`; errors are recorded, not raised."""
    main = torch.cuda.current_stream()
    row: dict[str, Any] = {}
    try:
        ctx_a, stream_a, how = green_stream(attn_sms)
        sms_a = sm_set(stream_a)
        row.update(how=how, attention_sms=len(sms_a))
        row["attention_half_alone_ms"] = timed(
            [stream_a], _repeat_on(stream_a, lambda: layer.attention(0, half), layers), repeats)
        row["halves_green_ms"] = timed([main, stream_a], halves(stream_a, main), repeats)
        try:
            ctx_b, stream_b, _ = green_stream(matmul_sms)
            sms_b = sm_set(stream_b)
            row.update(matmul_sms=len(sms_b), shared_sms=len(set(sms_a) & set(sms_b)))
            row["matmuls_half_alone_ms"] = timed(
                [stream_b], _repeat_on(stream_b, lambda: layer.matmuls(0, half), layers), repeats)
            row["halves_green2_ms"] = timed([stream_b, stream_a], halves(stream_a, stream_b),
                                            repeats)
            del ctx_b
        except Exception as e:  # recorded: a second partition may be refused
            row["green2_error"] = repr(e)[:200]
        del ctx_a
    except Exception as e:
        row["error"] = repr(e)[:200]
    print(attn_sms, row, flush=True)
    return row


def probe_case(layer: Layer, batch: int, layers: int, repeats: int,
               splits: list[int]) -> dict[str, Any]:
    half = batch // 2
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    res: dict[str, Any] = {}

    def serial() -> None:
        for _ in range(layers):
            layer.attention(0, batch)
            layer.matmuls(0, batch)

    def halves_serial() -> None:
        for _ in range(layers):
            for a, m in (((0, half), (half, batch)), ((half, batch), (0, half))):
                layer.attention(*a)
                layer.matmuls(*m)

    def halves(sa: torch.cuda.Stream, sm: torch.cuda.Stream) -> Callable[[], None]:
        def body() -> None:
            for _ in range(layers):
                for (a0, a1), (m0, m1) in (((0, half), (half, batch)),
                                           ((half, batch), (0, half))):
                    with torch.cuda.stream(sa):
                        layer.attention(a0, a1)
                    with torch.cuda.stream(sm):
                        layer.matmuls(m0, m1)
                    barrier(sa, sm)
        return body

    res["serial_ms"] = timed([main], serial, repeats)
    res["attention_full_ms"] = timed(
        [main], _repeat_on(main, lambda: layer.attention(0, batch), layers), repeats)
    res["matmuls_full_ms"] = timed(
        [main], _repeat_on(main, lambda: layer.matmuls(0, batch), layers), repeats)
    res["halves_serial_ms"] = timed([main], halves_serial, repeats)
    res["halves_streams_ms"] = timed([main, side], halves(main, side), repeats)
    greens = {str(s): probe_split(layer, s, num_sms - s, half, layers, repeats, halves)
              for s in splits}
    res["green"] = greens
    best = min([res["halves_streams_ms"]] + [r[k] for r in greens.values() for k in
                                             ("halves_green_ms", "halves_green2_ms") if k in r])
    res["best_overlapped_ms"] = best
    res["best_vs_serial"] = res["serial_ms"] / best
    res["kv_tb_s_full"] = layer.kv_bytes * layers / res["attention_full_ms"] / 1e9
    flops = 2 * batch * sum(i * o for i, o in PROJ) * layers
    res["matmul_tflop_s_full"] = flops / res["matmuls_full_ms"] / 1e9
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=768)
    p.add_argument("--ctx", type=int, default=1536)
    p.add_argument("--layers", type=int, default=8, help="layer-equivalents per timed run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--splits", default="24,40,56,72",
                   help="SM counts for the attention's green context")
    p.add_argument("--kv", default="fp8,bf16")
    args = p.parse_args()
    splits = [int(s) for s in args.splits.split(",")]
    doc: dict[str, Any] = {**environment_info(), "batch": args.batch, "ctx": args.ctx,
                           "layers": args.layers, "repeats": args.repeats,
                           "num_sms": torch.cuda.get_device_properties(0).multi_processor_count,
                           "device_sms_seen": len(sm_set(torch.cuda.current_stream())),
                           "cases": {}}
    for kv in args.kv.split(","):
        layer = Layer(args.batch, args.ctx, kv == "fp8")
        doc["cases"][kv] = probe_case(layer, args.batch, args.layers, args.repeats, splits)
        print(kv, {k: v for k, v in doc["cases"][kv].items() if k != "green"}, flush=True)
        del layer
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
