"""Does any decode-attention tile configuration reach the memory's rate on part of the SMs?
(run on the H200)

Overlapping decode attention (memory-bound) with the matmuls (compute-bound) on disjoint SMs
pays only if the attention keeps near its full-device rate on a partition of them:
`probe_green_ctx.py` found the default bf16 tiles at 3.5 TB/s on 72 SMs against 4.46 on all 132
(docs/performance.md, "What bounds random 1000x1000 now"). This probe sweeps the decode
kernel's tiles (KV positions per tile, warps, pipeline stages up to 6, grid order) and split
counts on green contexts of `--sms` SMs, bf16 cache, a batch of sequences of one context length,
and reports each partition's best configurations and KV-read rate beside the default's.

Usage: PYTHONPATH=. python3 tools/probes/probe_green_tiles.py --out F [--sms 56,72,88,104,0]
(0: the whole device, no green context)
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import torch

from bench.results import environment_info
from engine.kernels.decode_attention import (
    DecodeTiles,
    choose_decode_tiles,
    choose_num_splits,
    paged_decode_attention,
)
from tools.gpu.gpu_kernels_check import shuffled_block_tables
from tools.probes.probe_green_ctx import green_stream, sm_set, timed

H, HKV, D, BS = 32, 8, 128, 16
TILES = [DecodeTiles(n, w, st, hm) for n, w, st, hm in itertools.product(
    (32, 64, 128), (4, 8), (2, 3, 4), (False, True))]
# Deeper pipelines: more bytes in flight per SM, what a partition of fewer SMs would need.
TILES += [DecodeTiles(n, w, st, False) for n, w, st in (
    (32, 4, 5), (32, 4, 6), (32, 8, 6), (64, 4, 5), (64, 8, 5))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=384)
    p.add_argument("--ctx", type=int, default=1536)
    p.add_argument("--sms", default="56,72,88,104,0")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--calls", type=int, default=4, help="kernel calls per timing")
    args = p.parse_args()

    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    tables, num_blocks = shuffled_block_tables([args.ctx] * args.batch, BS, dev,
                                               torch.Generator().manual_seed(0))
    cache = torch.randn((2, num_blocks, BS, HKV, D), generator=gen, device=dev,
                        dtype=torch.bfloat16)
    seq_lens = torch.full((args.batch,), args.ctx, dtype=torch.int32, device=dev)
    q = torch.randn((args.batch, H, D), generator=gen, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = args.batch * args.ctx * HKV * D * 2 * cache.element_size()
    default_tiles = choose_decode_tiles(D, cache.dtype)
    default_splits = choose_num_splits(args.batch, HKV, args.ctx)
    splits_options = sorted({default_splits, max(1, default_splits // 2), default_splits * 2})

    def call(tiles: DecodeTiles, splits: int) -> None:
        paged_decode_attention(q, cache, tables, seq_lens, D ** -0.5, out=out,
                               max_seq_len=args.ctx, tiles=tiles, num_splits=splits)

    call(default_tiles, default_splits)
    ref = out.clone()
    partitions: list[dict[str, Any]] = []
    for sms in (int(x) for x in args.sms.split(",")):
        if sms:
            _ctx, stream, how = green_stream(sms)
            got = len(sm_set(stream))
        else:
            stream, how = torch.cuda.current_stream(), "whole device"
            got = torch.cuda.get_device_properties(0).multi_processor_count
        rows: list[dict[str, Any]] = []
        for tiles, splits in itertools.product(TILES, splits_options):
            try:
                with torch.cuda.stream(stream):
                    out.fill_(float("nan"))
                    call(tiles, splits)
                stream.synchronize()
                diff = float(((out.float() - ref.float()).abs().max()
                              / ref.float().abs().max()).item())

                def body(t: DecodeTiles = tiles, s: int = splits,
                         st: torch.cuda.Stream = stream) -> None:
                    with torch.cuda.stream(st):
                        for _ in range(args.calls):
                            call(t, s)
                ms = timed([stream], body, args.repeats) / args.calls
            except Exception as e:  # a config that does not compile (shared memory) is noted
                rows.append({"tiles": str(tiles), "splits": splits, "error": repr(e)[:120]})
                continue
            rows.append({"tiles": str(tiles), "splits": splits, "ms": ms,
                         "tb_s": kv_bytes / ms / 1e9, "rel_diff": diff,
                         "default": tiles == default_tiles and splits == default_splits})
        ok = sorted((r for r in rows if "ms" in r and r["rel_diff"] < 0.02),
                    key=lambda r: r["ms"])
        part: dict[str, Any] = {"sms_asked": sms, "sms": got, "how": how, "best": ok[:8],
                "default": [r for r in rows if r.get("default")],
                "errors": [r for r in rows if "error" in r or r.get("rel_diff", 0) >= 0.02]}
        partitions.append(part)
        best = ok[0] if ok else {}
        dflt = part["default"][0] if part["default"] else {}
        print(f"{got:4d} SMs: best {best.get('tb_s', 0):.2f} TB/s {best.get('tiles')} "
              f"splits {best.get('splits')}; default {dflt.get('tb_s', 0):.2f} TB/s", flush=True)
    doc = {**environment_info(), "batch": args.batch, "ctx": args.ctx, "kv_bytes": kv_bytes,
           "default_tiles": str(default_tiles), "default_splits": default_splits,
           "partitions": partitions}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
