"""Mixture-of-experts layers on the GPU: the Triton grouped GEMMs against the torch loop, in a
CUDA graph, and what they cost at real shapes.

For each shape (one Qwen3-30B-A3B layer: 128 experts of 768 over a hidden size of 2,048, 8 per
token; one Mixtral-8x7B layer: 8 experts of 14,336 over 4,096, 2 per token) and each token count:
random bf16 weights and inputs, a random router; `experts_fused` (engine/model/moe.py) against
`experts_torch` on the same bf16 inputs computed in float32 (the error relative to the output's
scale), then both timed (CUDA events, median of `--iters`). The fused layer is also captured in a
CUDA graph once per token count and replayed on new inputs (its result must equal the eager
call's bit for bit). Reported per row: ms, the bytes of the experts' weights the step touches
(every expert some token picked) over the time (GB/s), and the experts' TFLOP/s.

`--sweep`: instead, each GEMM of the layer (gate/up: the tokens' rows gathered, N = 2I, K = H;
down: the pairs' rows, N = H, K = I) alone, over row tiles and tile shapes, the fastest first
(what `engine/kernels/fused_moe.py`'s `layout_for` / `tile_for` table is chosen from).

`--align`: instead, sorting a step's pairs by expert (`align_pairs`) in one Triton program
against the torch ops, each captured in a CUDA graph and replayed (what a decode step pays per
MoE layer), for 128 and 8 experts and 64 to 16,384 pairs (ALIGN_KERNEL_WORK is chosen from it).

Usage: PYTHONPATH=. python3 tools/gpu/gpu_moe_check.py --out $OUT/moe_check.json [--sweep | --align]
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine.kernels.fused_moe import MoETile, align_pairs, layout_for, moe_gemm, tile_for
from engine.model.moe import experts_fused, experts_torch, route
from tools.probes.probe_bs1 import median_event_ms

SHAPES = {  # name: (experts, top_k, hidden, intermediate)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


def _time(fn: Callable[[], object], iters: int) -> float:
    """Median ms of `fn` over `iters` calls, each between two CUDA events."""
    return median_event_ms(fn, iters)


def check_shape(name: str, tokens: int, iters: int) -> dict[str, Any]:
    experts, top_k, hidden, inter = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=dev) * 0.02).to(bf16)
    down = (torch.randn(experts, hidden, inter, generator=gen, device=dev) * 0.02).to(bf16)
    router = (torch.randn(experts, hidden, generator=gen, device=dev) * 0.02).to(bf16)
    x = torch.randn(tokens, hidden, generator=gen, device=dev).to(bf16)
    weights, ids = route(x @ router.T, top_k, renormalise=True)
    want = experts_torch(x.float(), gate_up.float(), down.float(), weights, ids)
    got = experts_fused(x, gate_up, down, weights, ids)
    scale = want.abs().max().item()
    err = (got.float() - want).abs().max().item() / scale
    # Graph capture: the same call on a static input, replayed on new rows.
    static_x, static_w, static_ids = x.clone(), weights.clone(), ids.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        experts_fused(static_x, gate_up, down, static_w, static_ids)  # warm (compile) outside
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = experts_fused(static_x, gate_up, down, static_w, static_ids)
    x2 = torch.randn(tokens, hidden, generator=gen, device=dev).to(bf16)
    w2, ids2 = route(x2 @ router.T, top_k, renormalise=True)
    static_x.copy_(x2)
    static_w.copy_(w2)
    static_ids.copy_(ids2)
    graph.replay()
    eager = experts_fused(x2, gate_up, down, w2, ids2)
    graph_equal = bool(torch.equal(static_out, eager))
    fused_ms = _time(lambda: experts_fused(x, gate_up, down, weights, ids), iters)
    graph_ms = _time(graph.replay, iters)
    loop_ms = _time(lambda: experts_torch(x, gate_up, down, weights, ids), max(3, iters // 4))
    touched = int(torch.unique(ids).numel())
    weight_bytes = touched * 3 * hidden * inter * 2
    flops = 2 * tokens * top_k * 3 * hidden * inter
    row = {"shape": name, "tokens": tokens, "experts_touched": touched,
           "max_rel_err_vs_fp32": err, "graph_replay_equals_eager": graph_equal,
           "fused_ms": fused_ms, "graph_ms": graph_ms, "torch_loop_ms": loop_ms,
           "graph_weight_GBps": weight_bytes / graph_ms / 1e6,
           "graph_TFLOPs": flops / graph_ms / 1e9}
    del graph
    return row


SWEEP_TILES = [MoETile(32, 64, 4, 4), MoETile(64, 64, 4, 4), MoETile(128, 64, 4, 4),
               MoETile(64, 128, 4, 3), MoETile(128, 64, 8, 3), MoETile(128, 128, 8, 3),
               MoETile(256, 64, 8, 3)]


def sweep_shape(name: str, tokens: int, iters: int) -> list[dict[str, Any]]:
    """Every (row tile, tile) for both GEMMs of one layer at `tokens`, fastest first per GEMM;
    the default choice's time beside it."""
    experts, top_k, hidden, inter = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=dev) * 0.02).to(bf16)
    down = (torch.randn(experts, hidden, inter, generator=gen, device=dev) * 0.02).to(bf16)
    x = torch.randn(tokens, hidden, generator=gen, device=dev).to(bf16)
    ids = torch.rand(tokens, experts, generator=gen, device=dev).topk(top_k, dim=-1).indices
    act = torch.randn(tokens * top_k, inter, generator=gen, device=dev).to(bf16)
    routing = torch.rand(tokens * top_k, generator=gen, device=dev)
    gemms: dict[str, tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor | None]] = {
        "gate_up": (x, gate_up, True, None), "down": (act, down, False, routing)}
    layouts = [layout_for(ids, experts)] + [align_pairs(ids, experts, bm)
                                            for bm in (16, 32, 64, 128)]
    rows = []
    default = layouts[0]
    for gemm, (a, w, gather, rw) in gemms.items():
        default_ms = _time(partial(moe_gemm, a, w, default, top_k, gather, rw), iters)
        found: list[dict[str, Any]] = []
        for layout in layouts[1:] + ([default] if default.per_pair else []):
            for tile in SWEEP_TILES:
                try:
                    ms = _time(partial(moe_gemm, a, w, layout, top_k, gather, rw, tile=tile),
                               iters)
                except Exception as e:  # a tile that does not fit shared memory
                    found.append({"block_m": layout.block_m, "per_pair": layout.per_pair,
                                  "tile": [tile.block_n, tile.block_k, tile.num_warps,
                                           tile.num_stages], "error": str(e)[:200]})
                    continue
                found.append({"block_m": layout.block_m, "per_pair": layout.per_pair,
                              "block_n": tile.block_n, "block_k": tile.block_k,
                              "num_warps": tile.num_warps, "num_stages": tile.num_stages,
                              "ms": ms})
        timed = sorted((f for f in found if "ms" in f), key=lambda f: f["ms"])
        n_out, k_in = w.shape[1], w.shape[2]
        chosen = tile_for(default, n_out, k_in)
        rows.append({"shape": name, "tokens": tokens, "gemm": gemm,
                     "default": {"block_m": default.block_m, "per_pair": default.per_pair,
                                 "block_n": chosen.block_n, "block_k": chosen.block_k,
                                 "num_warps": chosen.num_warps,
                                 "num_stages": chosen.num_stages, "ms": default_ms},
                     "best": timed[:5], "errors": [f for f in found if "error" in f][:3]})
    return rows


def align_rows(iters: int) -> list[dict[str, Any]]:
    """Graph-replay ms of `align_pairs` by kernel and by torch ops."""
    rows = []
    for experts, top_k in ((128, 8), (8, 2)):
        for pairs in (64, 256, 1024, 3072, 8192, 16384):
            ids = torch.rand(pairs // top_k, experts, device="cuda").topk(top_k, dim=-1).indices
            block_m = layout_for(ids, experts).block_m
            row: dict[str, Any] = {"experts": experts, "pairs": pairs, "block_m": block_m}
            for way in ("kernel", "torch"):
                use = way == "kernel"
                align_pairs(ids, experts, block_m, use_kernel=use)  # compile outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    align_pairs(ids, experts, block_m, use_kernel=use)
                row[f"{way}_graph_ms"] = _time(graph.replay, iters)
                del graph
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tokens", default="1,4,16,64,256,1024,4096")
    p.add_argument("--max-rel-err", type=float, default=2e-2)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--align", action="store_true")
    args = p.parse_args()
    doc: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0),
                           "commit": os.environ.get("SPLITSERVE_COMMIT", ""),
                           "torch": torch.__version__, "rows": []}
    failed = 0
    if args.align:
        doc["align"] = align_rows(args.iters)
        Path(args.out).write_text(json.dumps(doc, indent=1))
        return 0
    if args.sweep:
        doc["sweep"] = []
        for name in SHAPES:
            for tokens in (int(t) for t in args.tokens.split(",")):
                for row in sweep_shape(name, tokens, args.iters):
                    doc["sweep"].append(row)
                    print(json.dumps({k: row[k] for k in ("shape", "tokens", "gemm",
                                                          "default")}),
                          json.dumps(row["best"][:2]), flush=True)
                Path(args.out).write_text(json.dumps(doc, indent=1))
        return 0
    for name in SHAPES:
        for tokens in (int(t) for t in args.tokens.split(",")):
            try:
                row = check_shape(name, tokens, args.iters)
                row["ok"] = row["max_rel_err_vs_fp32"] <= args.max_rel_err and row[
                    "graph_replay_equals_eager"]
            except Exception as e:  # recorded; the other shapes still run
                row = {"shape": name, "tokens": tokens, "ok": False,
                       "error": f"{type(e).__name__}: {e}"}
            failed += not row["ok"]
            doc["rows"].append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    doc["failed"] = failed
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
