"""Verify-step attention on the GPU: the split decode kernel with several query tokens per
sequence, swept over split counts and tiles, against the paged prefill kernel (run on the H200).

Usage: PYTHONPATH=. python3 tools/probes/probe_verify.py --out F [--batches 1,4,16,64] [--contexts 1024,4096]
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

import torch
from triton.testing import do_bench

from bench.results import git_info
from engine.kernels import paged_decode_attention, paged_prefill_attention
from engine.kernels.decode_attention import DecodeTiles, choose_num_splits
from tools.profiling import graph_replay_ms


def graph_us(fn: Callable[[], object]) -> float:
    """Median time of one call replayed from a CUDA graph of ten: the kernel alone, as the
    engine's verify graphs run it (plain do_bench of a ~10 us kernel measures the host's
    launch)."""
    return round(1e3 * graph_replay_ms(fn, do_bench, calls=10), 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--query-lens", default="1,5")
    args = p.parse_args()
    dev = torch.device("cuda")
    heads, kv_heads, dim, bs = 32, 8, 128, 16
    rows = []
    for batch in [int(x) for x in args.batches.split(",")]:
        for ctx in [int(x) for x in args.contexts.split(",")]:
            nblk = -(-ctx // bs)
            cache = torch.randn(2, batch * nblk + 1, bs, kv_heads, dim, device=dev,
                                dtype=torch.bfloat16)
            tables = torch.randperm(batch * nblk, device=dev, dtype=torch.int32).view(batch, nblk)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            for ql in [int(x) for x in args.query_lens.split(",")]:
                q = torch.randn(batch * ql, heads, dim, device=dev, dtype=torch.bfloat16)
                out = torch.empty_like(q)
                qsl = torch.arange(0, (batch + 1) * ql, ql, dtype=torch.int32, device=dev)
                row: dict[str, object] = {"batch": batch, "context": ctx, "query_len": ql,
                                          "default_splits": choose_num_splits(batch, kv_heads, ctx)}
                row["prefill_us"] = graph_us(functools.partial(
                    paged_prefill_attention, q, cache, qsl, seq_lens, tables, 0.088, ql,
                    out=out))
                times: dict[str, float] = {}
                for splits in (1, 2, 4, 8, 16, 32):
                    for tiles in (None, DecodeTiles(32, 4, 2, head_major=True),
                                  DecodeTiles(64, 8, 3, head_major=True)):
                        name = f"s{splits}" + ("" if tiles is None else
                                               f"_n{tiles.block_n}w{tiles.num_warps}")
                        times[name] = graph_us(functools.partial(
                            paged_decode_attention, q, cache, tables, seq_lens, 0.088, out=out,
                            num_splits=splits, tiles=tiles, query_len=ql))
                row.update(times)
                row["best"] = min(times, key=lambda k: times[k])
                rows.append(row)
                print(json.dumps(row))
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "git": git_info(), "gpu": torch.cuda.get_device_name()}, f,
                  indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
