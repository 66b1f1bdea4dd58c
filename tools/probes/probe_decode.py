"""Tile sweep of the paged decode attention kernel on the H200 (Llama-3.1-8B shapes).

Two regimes the engine runs the kernel in:

- `tput`: large batches at long contexts (random 1000x1000 decodes ~384 sequences of 1-2k
  tokens), bf16, fp8 and int8 caches (`--dtypes`); KV-read bandwidth per `DecodeTiles` (KV tile length, warps,
  pipeline stages, grid order), each config's output compared with the default config's.
- `bs1`: one sequence at 1k context, 32 calls on 32 distinct caches (as the 32 layers of a step,
  so L2 does not hold them) captured in one CUDA graph; µs per call by tiles and split count.
- `engine`: offline random 1000x1000 with an fp8 KV cache at `--max-num-seqs`, the kernel's
  tiles replaced in-process by the best fp8 tiles `tput` found (an experiment: the suite runs
  the committed defaults).

Usage: PYTHONPATH=. python3 tools/probes/probe_decode.py --out $OUT/probe_decode.json [--parts tput,bs1]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.results import environment_info
from engine.kernels._attention_tile import KvCvt
from engine.kernels._checks import FP8_KV_DTYPE, INT8_KV_DTYPE
from engine.kernels.decode_attention import (
    DecodeTiles,
    choose_decode_tiles,
    choose_num_splits,
    paged_decode_attention,
)
from tools.gpu.gpu_kernels_check import shuffled_block_tables
from tools.probes.probe_bs1 import graph_replay_ms

H, HKV, D, BS, LAYERS = 32, 8, 128, 16, 32
TPUT_SHAPES = ((384, 1536),)
TPUT_TILES = [DecodeTiles(n, w, st, hm) for n, w, st, hm in itertools.product(
    (32, 64, 128), (4, 8), (2, 3, 4), (False, True))]
# An fp8 cache also sweeps where its tiles become fp16 (`KvCvt`). Narrower otherwise: 32-position
# tiles at 4 warps and a fourth stage never won for fp8, 8 warps lost to 4 once V was converted in
# registers (probe_decode_fp8cvt_7f50869.json), and the grid order moved it by < 1%
# (probe_decode_25457d2.json). One and two warps per program are in: with 4 warps, ncu saw the
# kernel latency-bound at 12 warps per SM (`ncu_decode_fp8_9ab9ac6.txt`) and its loop has 9
# block-wide barriers per tile; with one warp they are warp-level.
FP8_TPUT_TILES = [DecodeTiles(n, w, st, False, cvt) for (n, w, st), cvt in itertools.product(
    ((32, 1, 2), (32, 1, 3), (64, 2, 2), (64, 2, 3), (64, 4, 3), (128, 4, 2), (128, 4, 3)),
    (KvCvt.V_REGS, KvCvt.KV_REGS))] + [DecodeTiles(128, 4, 4)]
# ncu put the one-warp program at 180 registers, 8 warps per SM, latency-bound
# (ncu_decode_fp8_1warp_c37dd9a.txt): capped registers (`maxnreg`) and 16-position tiles.
FP8_TPUT_TILES += [DecodeTiles(n, 1, st, False, KvCvt.V_REGS, reg) for n, st, reg in (
    (32, 2, 128), (32, 3, 128), (32, 2, 96), (32, 3, 96), (16, 2, None), (16, 3, None),
    (16, 4, None), (16, 3, 128), (16, 3, 96), (64, 2, 128))]
BS1_TILES = [DecodeTiles(n, 4, st, hm) for n, st, hm in itertools.product(
    (16, 32, 64), (2, 3), (False, True))]
BS1_SPLITS = (4, 8, 16, 32)
# int8 sweeps fp8's one-byte tiles, Triton's own conversion beside the in-register one, and the
# QK dot on int8 (`DecodeTiles.qk_int8`: K never converted).
INT8_TPUT_TILES = FP8_TPUT_TILES[:14] + [
    DecodeTiles(n, w, st, False, KvCvt.OPERAND) for n, w, st in (
        (32, 1, 3), (64, 4, 3), (128, 4, 3))] + [
    DecodeTiles(n, w, st, False, cvt, None, True) for n, w, st, cvt in (
        (16, 1, 3, KvCvt.V_REGS), (32, 1, 2, KvCvt.V_REGS), (32, 1, 3, KvCvt.V_REGS),
        (32, 1, 4, KvCvt.V_REGS), (64, 1, 3, KvCvt.V_REGS), (64, 2, 3, KvCvt.V_REGS),
        (128, 4, 3, KvCvt.V_REGS), (32, 1, 3, KvCvt.OPERAND), (64, 4, 3, KvCvt.OPERAND))]
MAX_REL_DIFF = 2e-2
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_KV_DTYPE, "int8": INT8_KV_DTYPE}
# Stored values are N(0, 1) times these (int8: rounded); the kernel multiplies them back.
KV_SCALES = {"bf16": (None, None), "fp8": (0.5, 0.25), "int8": (0.04, 0.03)}


def _do_bench(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.double() - ref.double()).norm().item()
    return diff / max(ref.double().norm().item(), 1e-30)


def _cache(num_blocks: int, kv: str, gen: torch.Generator) -> torch.Tensor:
    cache = torch.randn((2, num_blocks, BS, HKV, D), generator=gen, device="cuda")
    if kv == "int8":
        scales = torch.tensor(KV_SCALES["int8"], device="cuda").view(2, 1, 1, 1, 1)
        return (cache / scales).round().clamp(-127, 127).to(INT8_KV_DTYPE)
    return cache.to(CACHE_DTYPES[kv])


def _tput_case(batch: int, ctx: int, kv: str, gen: torch.Generator,
               cpu_gen: torch.Generator) -> dict[str, Any]:
    dev = torch.device("cuda")
    tables, num_blocks = shuffled_block_tables([ctx] * batch, BS, dev, cpu_gen)
    cache = _cache(num_blocks, kv, gen)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn((batch, H, D), generator=gen, device=dev).to(torch.bfloat16)
    k_scale, v_scale = KV_SCALES[kv]
    kv_bytes = batch * ctx * HKV * D * 2 * cache.element_size()
    out = torch.empty_like(q)

    def call(tiles: DecodeTiles | None) -> None:
        paged_decode_attention(q, cache, tables, seq_lens, D ** -0.5, out=out,
                               max_seq_len=ctx, tiles=tiles, k_scale=k_scale, v_scale=v_scale)

    call(None)
    ref = out.clone()
    default = choose_decode_tiles(D, cache.dtype)
    rows: list[dict[str, Any]] = []
    for tiles in {"bf16": TPUT_TILES, "fp8": FP8_TPUT_TILES, "int8": INT8_TPUT_TILES}[kv]:
        try:
            out.fill_(float("nan"))
            call(tiles)
            diff = _rel_diff(out, ref)
            ms = _do_bench(functools.partial(call, tiles))
        except Exception as e:  # a config that does not compile (registers) is recorded
            rows.append({**dataclasses.asdict(tiles), "kv_cvt": tiles.kv_cvt.name,
                         "error": str(e)[:120]})
            continue
        rows.append({"block_n": tiles.block_n, "warps": tiles.num_warps,
                     "stages": tiles.num_stages, "head_major": tiles.head_major,
                     "kv_cvt": tiles.kv_cvt.name, "maxnreg": tiles.maxnreg,
                     "qk_int8": tiles.qk_int8, "ms": ms,
                     "tb_s": kv_bytes / ms / 1e9, "rel_diff": diff,
                     "ok": bool(diff < MAX_REL_DIFF), "default": tiles == default})
    ok = sorted((r for r in rows if r.get("ok")), key=lambda r: r["ms"])
    return {"kv_bytes": kv_bytes, "num_splits": choose_num_splits(batch, HKV, ctx),
            "best": ok[:10], "default": [r for r in rows if r.get("default")],
            "bad": [r for r in rows if not r.get("ok")]}


def probe_tput(dtypes: tuple[str, ...]) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    res: dict[str, Any] = {}
    for (batch, ctx), kv in itertools.product(TPUT_SHAPES, dtypes):
        key = f"{kv}_b{batch}_ctx{ctx}"
        res[key] = _tput_case(batch, ctx, kv, gen, cpu_gen)
        print(key, "best", res[key]["best"][:2], "default", res[key]["default"], flush=True)
        torch.cuda.empty_cache()
    return res


def probe_bs1() -> dict[str, Any]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    cpu_gen = torch.Generator().manual_seed(1)
    ctx = 1024
    tables, num_blocks = shuffled_block_tables([ctx], BS, dev, cpu_gen)
    caches = [_cache(num_blocks, "bf16", gen) for _ in range(LAYERS)]
    seq_lens = torch.full((1,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn((1, H, D), generator=gen, device=dev).to(torch.bfloat16)
    outs = [torch.empty_like(q) for _ in range(LAYERS)]

    def step(tiles: DecodeTiles | None, splits: int | None) -> None:
        for cache, out in zip(caches, outs, strict=True):
            paged_decode_attention(q, cache, tables, seq_lens, D ** -0.5, out=out,
                                   max_seq_len=ctx, num_splits=splits, tiles=tiles)

    step(None, None)
    refs = [o.clone() for o in outs]
    default_ms = graph_replay_ms(lambda: step(None, None))
    rows: list[dict[str, Any]] = []
    for tiles, splits in itertools.product(BS1_TILES, BS1_SPLITS):
        try:
            step(tiles, splits)
            diff = max(_rel_diff(o, r) for o, r in zip(outs, refs, strict=True))
            ms = graph_replay_ms(functools.partial(step, tiles, splits))
        except Exception as e:
            rows.append({"block_n": tiles.block_n, "splits": splits, "error": str(e)[:120]})
            continue
        rows.append({"block_n": tiles.block_n, "stages": tiles.num_stages,
                     "head_major": tiles.head_major, "splits": splits,
                     "us_per_call": ms * 1e3 / LAYERS, "rel_diff": diff,
                     "ok": bool(diff < MAX_REL_DIFF)})
    ok = sorted((r for r in rows if r.get("ok")), key=lambda r: r["us_per_call"])
    res = {"context": ctx, "default_num_splits": choose_num_splits(1, HKV, ctx),
           "default_us_per_call": default_ms * 1e3 / LAYERS, "best": ok[:8],
           "bad": [r for r in rows if not r.get("ok")]}
    print("bs1", res, flush=True)
    return res


def probe_engine(doc: dict[str, Any], max_num_seqs: int, graph_max_batch: int,
                 kv_dtype: str = "fp8") -> dict[str, Any]:
    """random 1000x1000 with the `tput` part's best tiles patched in, on a `kv_dtype` cache
    ("fp8" or "auto": bf16); its default-tile twin is `h200_suite.py --steps
    throughput_random[_fp8]`."""
    from bench import models
    from engine.kernels import decode_attention
    from tools.gpu import h200_suite

    best = {}
    for dtype in ("bf16", "fp8"):
        keys = [k for k in doc.get("tput", {}) if k.startswith(dtype)]
        rows = doc["tput"][keys[-1]]["best"] if keys else []
        if rows:
            r = rows[0]
            best[dtype] = DecodeTiles(r["block_n"], r["warps"], r["stages"], r["head_major"],
                                      KvCvt[r.get("kv_cvt", r.get("fp8_cvt", "OPERAND"))],
                                      r.get("maxnreg"))
    default = decode_attention.choose_decode_tiles

    def patched(head_dim: int, kv_dtype: torch.dtype | None = None,
                num_splits: int = 1) -> DecodeTiles:
        key = "fp8" if kv_dtype == FP8_KV_DTYPE else "bf16"
        return best.get(key) or default(head_dim, kv_dtype, num_splits)

    decode_attention.choose_decode_tiles = patched  # type: ignore[assignment]
    sizes = h200_suite.SuiteSizes(max_num_seqs=max_num_seqs, cuda_graph_max_batch=graph_max_batch)
    holder = h200_suite.EngineHolder(sizes)
    try:
        vocab = models.vocab_size_for(sizes.model)
        result = h200_suite._throughput(holder, vocab, sizes.tput_num_prompts,
                                        sizes.tput_input_len, sizes.tput_output_len,
                                        kv_cache_dtype=kv_dtype)
    finally:
        holder.release()
        decode_attention.choose_decode_tiles = default  # type: ignore[assignment]
    res = {"tiles": {k: dataclasses.asdict(v) for k, v in best.items()},
           "max_num_seqs": max_num_seqs, "cuda_graph_max_batch": graph_max_batch,
           f"throughput_random_{'bf16' if kv_dtype == 'auto' else kv_dtype}": result}
    print("engine", res, flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="tput,bs1")
    p.add_argument("--max-num-seqs", type=int, default=512, help="of the `engine` part")
    p.add_argument("--dtypes", default="bf16,fp8",
                   help="caches the `tput` part sweeps: bf16, fp8, int8")
    p.add_argument("--cuda-graph-max-batch", type=int, default=512, help="of the `engine` part")
    p.add_argument("--engine-kv-dtype", default="fp8", choices=["fp8", "auto"],
                   help="the `engine` part's cache (auto: bf16)")
    args = p.parse_args()
    doc: dict[str, Any] = {"environment": environment_info()}
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "tput": lambda: probe_tput(tuple(args.dtypes.split(","))), "bs1": probe_bs1,
        "engine": lambda: probe_engine(doc, args.max_num_seqs, args.cuda_graph_max_batch,
                                       args.engine_kv_dtype)}
    for name in args.parts.split(","):
        start = time.perf_counter()
        doc[name] = parts[name]()
        doc[f"{name}_s"] = round(time.perf_counter() - start, 1)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
