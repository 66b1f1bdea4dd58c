"""Tile sweep of the paged prefill attention kernel for head_dim 256 (Gemma 2 / 3) on the H200.

`choose_prefill_tiles` picked head_dim 256's tiles by scaling the swept head_dim 128 ones, not
by measuring. This times every `PrefillTiles` candidate on a fresh prompt (one sequence, all
positions causal, as a Gemma layer whose soft cap keeps it off SDPA runs it) and on a chunked
prefill beside cached context, with and without the layer's window and cap; each candidate's
output is compared with the current choice's. Candidates that do not compile (shared memory)
are recorded as such.

Usage: PYTHONPATH=. python3 tools/probes/probe_prefill_tiles.py --out $OUT/probe_prefill_tiles.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import asdict
from typing import Any

import torch

from bench.results import environment_info
from engine.kernels.prefill_attention import (
    PrefillTiles,
    choose_prefill_tiles,
    paged_prefill_attention,
)
from tools.gpu.gpu_kernels_check import shuffled_block_tables


def _visible(q_lens: list[int], prefixes: list[int], window: int) -> int:
    """Query-key pairs attended: query at position p sees p + 1 keys, at most `window` (> 0)."""
    return sum(min(pos + 1, window) if window else pos + 1
               for p, n in zip(prefixes, q_lens, strict=True) for pos in range(p, p + n))


def _case(q_lens: list[int], prefixes: list[int], heads: int, kv_heads: int, head_dim: int,
          block_size: int, gen: torch.Generator) -> dict[str, Any]:
    """Inputs of one prefill: sequences with `prefixes[i]` cached and `q_lens[i]` new tokens."""
    lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    tables, num_blocks = shuffled_block_tables(lens, block_size, torch.device("cuda"),
                                               torch.Generator().manual_seed(0))
    cache = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), generator=gen,
                        device="cuda").to(torch.bfloat16)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn((starts[-1], heads, head_dim), generator=gen, device="cuda").to(torch.bfloat16)
    return {"q": q, "cache": cache, "tables": tables, "max_q": max(q_lens),
            "qsl": torch.tensor(starts, dtype=torch.int32, device="cuda"),
            "seq_lens": torch.tensor(lens, dtype=torch.int32, device="cuda")}


def _time(fn: Any) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    d = args.head_dim
    cases = {f"fresh_{args.len}": ([args.len], [0]),
             "chunks_beside_context": ([2048, 512, 1024], [4096, 3000, 0])}
    layers = {"plain": (0, 0.0), "window_softcap": (args.window, args.softcap)}
    candidates = [PrefillTiles(m, n, w, s) for m, n, w, s in itertools.product(
        (64, 128), (32, 64), (4, 8), (1, 2, 3))]
    rows: list[dict[str, Any]] = []
    for (case_name, (q_lens, prefixes)), (layer_name, (window, cap)) in itertools.product(
            cases.items(), layers.items()):
        c = _case(q_lens, prefixes, args.heads, args.kv_heads, d, 16, gen)
        # 2 matmuls x 2 flop per multiply-add over the pairs the layer attends
        flops = 4.0 * _visible(q_lens, prefixes, window) * args.heads * d
        default = choose_prefill_tiles(d, c["max_q"])

        def call(tiles: PrefillTiles, c: dict[str, Any] = c, window: int = window,
                 cap: float = cap) -> torch.Tensor:
            return paged_prefill_attention(c["q"], c["cache"], c["qsl"], c["seq_lens"],
                                           c["tables"], d ** -0.5, c["max_q"], tiles=tiles,
                                           sliding_window=window, logit_softcap=cap)

        want = call(default).float()
        for tiles in [default, *[t for t in candidates if t != default]]:
            row: dict[str, Any] = {"case": case_name, "layer": layer_name,
                                   "tiles": asdict(tiles), "default": tiles == default}
            try:
                got = call(tiles).float()
                row["max_abs_diff"] = float((got - want).abs().max())
                ms = _time(lambda tiles=tiles: call(tiles))
                row.update(ms=ms, tflop_per_s=flops / (ms * 1e-3) / 1e12)
            except Exception as exc:  # too much shared memory, an unsupported layout
                row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    best: dict[str, Any] = {}
    for row in rows:
        key = f"{row['case']}/{row['layer']}"
        if "ms" in row and (key not in best or row["ms"] < best[key]["ms"]):
            best[key] = row
    return {"environment": environment_info(), "head_dim": d, "heads": args.heads,
            "kv_heads": args.kv_heads, "window": args.window, "softcap": args.softcap,
            "best": best, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--len", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)  # Gemma-3-12B's
    p.add_argument("--softcap", type=float, default=50.0)
    args = p.parse_args()
    start = time.perf_counter()
    doc = sweep(args)
    doc["wall_s"] = time.perf_counter() - start
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    for key, row in doc["best"].items():
        print(key, row["tiles"], round(row["ms"], 3), "ms", round(row["tflop_per_s"], 1))


if __name__ == "__main__":
    main()
