"""INT8 weight-only GEMV on the H200: the four batch-1 calls of Llama-3.1-8B (norm-fused QKV and
gate/up, plain O and down) with int8 weights and per-row scales, for each way of turning the
weights into floats (`Int8Cvt`) and a few tiles, next to the bf16 GEMV at its tuned tiles.

Each timing is one CUDA graph of 32 calls with distinct weights (as the 32 layers of a step, so
L2 never holds them). Every config's output is compared with the `I2F` config's at the same
tiles: the conversions are exact and the summation order is the same, so they must be equal.

With `--parts w8a16`, the same four weights at 8 and 64 rows (decode batches 8 and 64) through
the W8A16 matmul (engine/kernels/w8a16.py) for a set of tiles, next to cuBLAS on bf16 weights.

With `--parts dequant`, the W8A16 matmul at its default tiles against `w8a16_linear`'s other
route (the weight widened by `dequantize_int8`, then cuBLAS), at 256 to 4096 rows: where
`DEQUANT_MIN_ROWS` comes from. (The first widening, at 6521564, scaled cuBLAS's output in
float32 instead and lost everywhere but the down projection at 4096 rows:
probe_int8_dequant_6521564.json.)

Usage: PYTHONPATH=. python3 tools/probes/probe_int8_gemv.py --out $OUT/probe_int8_gemv.json
       [--parts gemv,w8a16,dequant]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from bench.results import environment_info
from engine.kernels import gemv as gemv_mod
from engine.kernels import w8a16 as w8a16_mod
from engine.kernels.gemv import GemvTiles, Int8Cvt, gemv, rms_norm_gemv
from engine.kernels.w8a16 import MatmulTiles, dequantize_int8, w8a16_matmul
from tools.probes.probe_bs1 import graph_replay_ms

HIDDEN, INTER, QKV, LAYERS, EPS = 4096, 14336, 6144, 32, 1e-5
SHAPES = {"qkv": (QKV, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "o": (HIDDEN, HIDDEN),
          "down": (HIDDEN, INTER)}
TILES = [(4, 1024, 4, 4), (4, 2048, 4, 4), (8, 1024, 4, 4), (8, 2048, 8, 4), (16, 1024, 8, 3)]


def _calls(name: str, weights: list[torch.Tensor], scales: list[torch.Tensor] | None,
           x: torch.Tensor, res: torch.Tensor, norm_w: torch.Tensor) -> list[torch.Tensor]:
    outs = []
    for i, w in enumerate(weights):
        scale = None if scales is None else scales[i]
        if name in ("qkv", "gate_up"):
            y, _ = rms_norm_gemv(x, norm_w, EPS, w, residual=res, gated=name == "gate_up",
                                 weight_scale=scale)
        else:
            y = gemv(x, w, weight_scale=scale)
        outs.append(y)
    return outs


def _replay_ms(name: str, weights: list[torch.Tensor], scales: list[torch.Tensor] | None,
               x: torch.Tensor, res: torch.Tensor, norm_w: torch.Tensor) -> float:
    def step() -> None:
        _calls(name, weights, scales, x, res, norm_w)

    return graph_replay_ms(step, reps=10)


def _int8_layers(n: int, k: int, gen: torch.Generator
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """LAYERS random int8 weights `[n, k]` and their positive per-row scales, on the GPU."""
    dev = torch.device("cuda")
    q = [torch.randint(-127, 128, (n, k), generator=gen, device=dev, dtype=torch.int8)
         for _ in range(LAYERS)]
    scales = [torch.rand(n, generator=gen, device=dev) * 1e-3 + 1e-4 for _ in range(LAYERS)]
    return q, scales


def _timed(entry: dict[str, Any], check: Callable[[], None], step: Callable[[], None],
           weight_bytes: int) -> dict[str, Any]:
    """`check()` (which records its findings in `entry`), then `step()` timed in a CUDA graph;
    a config the compiler refuses is recorded with its error, not fatal."""
    try:
        check()
        ms = graph_replay_ms(step, reps=10)
    except Exception as e:
        entry["error"] = repr(e)[:200]
        return entry
    entry.update(us_per_call=ms * 1e3 / LAYERS, tb_s=weight_bytes * LAYERS / ms / 1e9)
    return entry


def probe_shape(name: str, gen: torch.Generator) -> dict[str, Any]:
    dev = torch.device("cuda")
    rows, k = SHAPES[name]
    q, scales = _int8_layers(rows, k, gen)
    x = torch.randn(1, k, generator=gen, device=dev).to(torch.bfloat16)
    res = torch.randn(1, k, generator=gen, device=dev).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen, device=dev)).to(torch.bfloat16)
    n = rows // 2 if name == "gate_up" else rows
    original = gemv_mod.choose_gemv_tiles
    default = original(n, k, name == "gate_up")
    rows_out: list[dict[str, Any]] = []
    refs: dict[tuple[int, ...], torch.Tensor] = {}
    try:
        for tile, cvt in itertools.product(TILES, Int8Cvt):
            tiles = GemvTiles(*tile, int8_cvt=cvt)
            gemv_mod.choose_gemv_tiles = lambda *_a, t=tiles: t  # type: ignore[assignment]
            entry: dict[str, Any] = {"tiles": list(tile), "int8_cvt": cvt.name,
                                     "default": tiles == default}

            def check(entry: dict[str, Any] = entry, tile: tuple[int, ...] = tile,
                      cvt: Int8Cvt = cvt) -> None:
                out = torch.cat(_calls(name, q, scales, x, res, norm_w))
                if cvt == Int8Cvt.I2F:
                    refs[tile] = out
                entry["equal_to_i2f"] = bool(torch.equal(out, refs[tile]))

            def step() -> None:
                _calls(name, q, scales, x, res, norm_w)

            rows_out.append(_timed(entry, check, step, rows * k))
    finally:
        gemv_mod.choose_gemv_tiles = original  # type: ignore[assignment]
    q.clear()  # free the int8 weights before the bf16 ones are made
    w16 = [torch.randn(rows, k, generator=gen, device=dev).to(torch.bfloat16) * 0.02
           for _ in range(LAYERS)]
    ms16 = _replay_ms(name, w16, None, x, res, norm_w)
    w16.clear()
    torch.cuda.empty_cache()
    ok = sorted((r for r in rows_out if "us_per_call" in r), key=lambda r: r["us_per_call"])
    return {"n": n, "k": k, "bf16_us_per_call": ms16 * 1e3 / LAYERS,
            "bf16_tb_s": rows * k * 2 * LAYERS / ms16 / 1e9,
            "default": [r for r in ok if r["default"]], "best": ok[:6], "all": rows_out}


W8A16_ROWS = (8, 64)
# Decode batches above 64 rows run in CUDA graphs on the kernel (`w8a16_linear` widens only
# outside captures), at tiles that were never swept: `--w8a16-rows 8,64,256,512` adds them.
_LARGE_TILES = [MatmulTiles(*t) for t in (
    (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3),
    (64, 64, 128, 4, 4), (128, 128, 128, 8, 3), (64, 256, 64, 8, 3))]
W8A16_TILES = {
    8: [MatmulTiles(16, n, k, 4, st) for n, k, st in itertools.product(
        (16, 32, 64, 128), (128, 256), (3, 4))],
    64: [MatmulTiles(*t) for t in ((64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 32, 128, 4, 4),
                                   (64, 64, 128, 4, 3), (32, 64, 128, 4, 4), (16, 64, 128, 4, 4),
                                   (16, 32, 256, 4, 3), (32, 32, 128, 4, 4))],
    256: _LARGE_TILES,
    512: _LARGE_TILES,
}


def probe_w8a16(name: str, m: int, gen: torch.Generator) -> dict[str, Any]:
    dev = torch.device("cuda")
    n, k = SHAPES[name]
    q, scales = _int8_layers(n, k, gen)
    x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
    original = w8a16_mod.choose_w8a16_tiles
    default = original(m, n)

    def step() -> None:
        for w, sc in zip(q, scales, strict=True):
            w8a16_matmul(x, w, sc)

    rows: list[dict[str, Any]] = []
    ref = w8a16_matmul(x, q[0], scales[0])
    try:
        for tiles in W8A16_TILES[m]:
            w8a16_mod.choose_w8a16_tiles = lambda *_a, t=tiles: t  # type: ignore[assignment]
            entry: dict[str, Any] = {"tiles": [tiles.block_m, tiles.block_n, tiles.block_k,
                                               tiles.num_warps, tiles.num_stages],
                                     "default": tiles == default}

            def check(entry: dict[str, Any] = entry) -> None:
                got = w8a16_matmul(x, q[0], scales[0])
                entry["rel_diff"] = float((got.float() - ref.float()).norm()
                                          / ref.float().norm())

            rows.append(_timed(entry, check, step, n * k))
    finally:
        w8a16_mod.choose_w8a16_tiles = original  # type: ignore[assignment]
    q.clear()
    w16 = [torch.randn(n, k, generator=gen, device=dev).to(torch.bfloat16) * 0.02
           for _ in range(LAYERS)]

    def cublas() -> None:
        for w in w16:
            F.linear(x, w)

    ms16 = graph_replay_ms(cublas, reps=10)
    w16.clear()
    torch.cuda.empty_cache()
    ok = sorted((r for r in rows if "us_per_call" in r), key=lambda r: r["us_per_call"])
    return {"m": m, "n": n, "k": k, "cublas_bf16_us_per_call": ms16 * 1e3 / LAYERS,
            "default": [r for r in ok if r["default"]], "best": ok[:6], "all": rows}


DEQUANT_ROWS = (256, 512, 768, 1024, 2048, 4096)


def probe_dequant(name: str, gen: torch.Generator) -> dict[str, Any]:
    dev = torch.device("cuda")
    n, k = SHAPES[name]
    q, scales = _int8_layers(n, k, gen)
    res: dict[str, Any] = {}
    for m in DEQUANT_ROWS:
        x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)

        def kernel(x: torch.Tensor = x) -> None:
            for w, sc in zip(q, scales, strict=True):
                w8a16_matmul(x, w, sc)

        def widened(x: torch.Tensor = x) -> None:  # w8a16_linear's route from DEQUANT_MIN_ROWS
            for w, sc in zip(q, scales, strict=True):
                F.linear(x, dequantize_int8(w, sc, x.dtype))

        res[f"m{m}"] = {"w8a16_us_per_call": graph_replay_ms(kernel, reps=5) * 1e3 / LAYERS,
                        "dequant_cublas_us_per_call":
                            graph_replay_ms(widened, reps=5) * 1e3 / LAYERS}
    q.clear()
    torch.cuda.empty_cache()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="gemv,w8a16")
    p.add_argument("--w8a16-rows", default=",".join(map(str, W8A16_ROWS)),
                   help=f"rows the w8a16 part sweeps, from {sorted(W8A16_TILES)}")
    args = p.parse_args()
    parts = args.parts.split(",")
    rows = [int(r) for r in args.w8a16_rows.split(",")]
    if not set(rows) <= set(W8A16_TILES):
        p.error(f"--w8a16-rows: each of {rows} must be one of {sorted(W8A16_TILES)}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    doc: dict[str, Any] = {"environment": environment_info(), "shapes": {}, "w8a16": {}}
    for name in SHAPES:
        if "gemv" in parts:
            doc["shapes"][name] = probe_shape(name, gen)
            s = doc["shapes"][name]
            print(name, "bf16", round(s["bf16_us_per_call"], 2), "us; default",
                  s["default"][:1], "best", s["best"][:2], flush=True)
        if "w8a16" in parts:
            for m in rows:
                r = doc["w8a16"][f"{name}_m{m}"] = probe_w8a16(name, m, gen)
                print(name, m, "cublas", round(r["cublas_bf16_us_per_call"], 2), "us; default",
                      r["default"][:1], "best", r["best"][:2], flush=True)
        if "dequant" in parts:
            r = doc.setdefault("dequant", {})[name] = probe_dequant(name, gen)
            print(name, "dequant", r, flush=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
