"""How many runs of consecutive blocks a decode worker's pulled prompts get over a long life
(CPU, bookkeeping only: the engine's `BlockPool`, no model).

A same-GPU KV pull is one copy-engine copy per run of blocks consecutive on both sides
(engine/dma_copy.py), and on a busy GPU each copy waits ~50-100 us behind the process's kernels
(bench/results/h200/kv_ipc_pull_fix/): a prompt in one run costs one copy, a scattered one a
copy per block. A fresh pool hands out consecutive ids; a long-running decode worker frees
requests whose blocks grew one at a time, interleaved with every other request's. This
simulates that life: up to `--concurrency` requests decode together, one token per step; each
new one first takes its prompt's blocks at once (the pull), then a block every `--block-size`
tokens; a finished one frees its blocks (in reverse, as the engine does) and the next one is
admitted when its prompt fits beside room for the running ones' growth. For each
pulled prompt it counts the runs of its block ids, over the same arrivals, with three pools:
`RunKeepingBlockPool` (what the prefill and decode roles use), the LRU pool with its
ascending order (colocated engines; since d29ac28) and the LRU order before that.

Usage: PYTHONPATH=. python3 tools/probes/probe_block_runs.py --out F [--num-blocks 19670]
       [--concurrency 64] [--requests 4000] [--old-fraction 0.5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.results import git_info
from engine.kv.block_pool import Block, BlockPool, RunKeepingBlockPool
from worker.kv import count_runs


class LruOrderPool(BlockPool):
    """The pool before d29ac28: new blocks in the order the free queue gave them."""

    def get_new_blocks(self, n: int) -> list[Block]:
        order = [b.block_id for _, b in zip(range(n), self.free_queue, strict=False)]
        blocks = {b.block_id: b for b in super().get_new_blocks(n)}
        return [blocks[i] for i in order]


@dataclass
class Live:
    blocks: list[Block]
    tokens: int
    remaining: int
    extra: list[Block] = field(default_factory=list)


def simulate(pool: BlockPool, args: argparse.Namespace,
             stats: dict[str, int] | None = None) -> list[int]:
    """→ the runs of each pulled prompt (its blocks not found in the prefix cache), in arrival
    order. With `args.shared_prefixes` > 0 each prompt starts with one of that many prefixes
    (Zipf-popular, 256-1,024 tokens each), whose full blocks are cached and looked up as the
    engine does; `stats` then gets the prefix blocks asked for and found."""
    rng = random.Random(args.seed)
    bs = args.block_size
    live: list[Live] = []
    out: list[int] = []
    arrivals = 0
    num_prefixes = getattr(args, "shared_prefixes", 0)
    prefix_rng = random.Random(args.seed + 1)  # apart: the prompts' lengths stay as without
    prefix_blocks = [prefix_rng.randint(256, 1024) // bs for _ in range(num_prefixes)]
    popularity = [1.0 / (k + 1) for k in range(num_prefixes)]
    counts = stats if stats is not None else {}
    counts.update(prefix_blocks=0, hit_blocks=0)

    # Room kept for the running requests' growth, as a scheduler admits only what fits.
    reserve = args.concurrency * -(-args.max_output // bs)
    next_prompt = rng.randint(args.min_prompt, args.max_prompt)

    def draw_prefix() -> int:
        return prefix_rng.choices(range(num_prefixes), popularity)[0] if num_prefixes else -1

    next_prefix = draw_prefix()

    def admit() -> None:
        nonlocal arrivals, next_prompt, next_prefix
        while len(live) < args.concurrency and arrivals < args.requests:
            # The prompt: the prefix's blocks (if any), then its own `next_prompt` tokens.
            hashes = ([f"{next_prefix}/{i}".encode() for i in range(prefix_blocks[next_prefix])]
                      if next_prefix >= 0 else [])
            hits: list[Block] = []
            for h in hashes:
                b = pool.get_cached_block(h)
                if b is None:
                    break
                hits.append(b)
            new = len(hashes) + -(-next_prompt // bs) - len(hits)
            if pool.num_free_blocks < new + sum(b.ref_cnt == 0 for b in hits) + reserve:
                return
            pool.touch(hits)
            blocks = pool.get_new_blocks(new)
            out.append(count_runs([b.block_id for b in blocks]))
            for b, h in zip(blocks, hashes[len(hits):], strict=False):
                pool.cache_block(b, h)
            counts["prefix_blocks"] += len(hashes)
            counts["hit_blocks"] += len(hits)
            live.append(Live(hits + blocks, next_prompt + len(hashes) * bs,
                             rng.randint(args.min_output, args.max_output)))
            arrivals += 1
            next_prompt = rng.randint(args.min_prompt, args.max_prompt)
            next_prefix = draw_prefix()

    admit()
    while live:
        for r in list(live):
            if r.tokens % bs == 0:  # the next token starts a block
                if not r.extra:  # `--growth-chunk` blocks at a time, the rest held for later
                    r.extra = pool.get_new_blocks(min(args.growth_chunk,
                                                      -(-r.remaining // bs)))
                r.blocks.append(r.extra.pop(0))
            r.tokens += 1
            r.remaining -= 1
            if r.remaining == 0:
                live.remove(r)
                pool.free_blocks(list(reversed(r.blocks + r.extra)))
        admit()
    return out


def _timed(pool: BlockPool) -> dict[str, list[float]]:
    """Time the pool's `get_new_blocks` and `free_blocks` (wrapped on the instance): kind ->
    [seconds, blocks]; kinds "single", "prompt" and "free"."""
    calls: dict[str, list[float]] = {"single": [0.0, 0], "prompt": [0.0, 0], "free": [0.0, 0]}
    get_new_blocks, free_blocks = pool.get_new_blocks, pool.free_blocks

    def timed_get(n: int) -> list[Block]:
        t = time.perf_counter()
        out = get_new_blocks(n)
        c = calls["single" if n == 1 else "prompt"]
        c[0] += time.perf_counter() - t
        c[1] += n
        return out

    def timed_free(blocks_in_eviction_order: list[Block]) -> None:
        t = time.perf_counter()
        free_blocks(blocks_in_eviction_order)
        calls["free"][0] += time.perf_counter() - t
        calls["free"][1] += len(blocks_in_eviction_order)

    pool.get_new_blocks = timed_get  # type: ignore[method-assign]
    pool.free_blocks = timed_free  # type: ignore[method-assign]
    return calls


def summary(values: list[int], skip: int) -> dict[str, Any]:
    steady = sorted(values[skip:])
    pick = lambda q: steady[min(len(steady) - 1, int(q * len(steady)))]  # noqa: E731
    return {"pulls": len(steady), "mean_runs": round(statistics.fmean(steady), 2),
            "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": steady[-1],
            "one_run_share": round(sum(v == 1 for v in steady) / len(steady), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--num-blocks", type=int, default=19670)  # the H200 probe's decode worker
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--min-prompt", type=int, default=512)
    p.add_argument("--max-prompt", type=int, default=4000)
    p.add_argument("--min-output", type=int, default=64)
    p.add_argument("--max-output", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared-prefixes", type=int, default=0,
                   help="prompts start with one of this many cached prefixes (0: none)")
    p.add_argument("--old-fraction", type=float, default=0.5,
                   help="RunKeepingBlockPool's share of older free blocks (its default: 0.5)")
    p.add_argument("--growth-chunk", type=int, default=1,
                   help="decode blocks taken at a time (1: the engine's way; more: a what-if, "
                        "the extra ones held by the request until it needs them)")
    args = p.parse_args()
    rows: dict[str, Any] = {}
    pools = (("run_keeping", lambda: RunKeepingBlockPool(args.num_blocks, True,
                                                          args.old_fraction)),
             ("ascending", lambda: BlockPool(args.num_blocks, True)),
             ("lru_order", lambda: LruOrderPool(args.num_blocks, True)))
    for name, make in pools:
        start = time.perf_counter()
        counts: dict[str, int] = {}
        pool = make()
        calls = _timed(pool)
        values = simulate(pool, args, counts)
        # The first `concurrency` pulls come from a fresh pool: the steady state is after.
        rows[name] = {"seconds": round(time.perf_counter() - start, 2),  # pool + simulation
                      # host time inside the pool per block: handed out alone (decode growth),
                      # with others (a prompt), freed
                      "us_per_block": {k: round(sec / n * 1e6, 2) for k, (sec, n) in calls.items()
                                       if n},
                      "prefix_hit_rate": (round(counts["hit_blocks"] / counts["prefix_blocks"], 4)
                                          if counts["prefix_blocks"] else None),
                      "first_pulls": summary(values[:args.concurrency], 0),
                      "steady": summary(values, args.concurrency),
                      # mean runs per window of 250 pulls: how fast a fresh pool fragments
                      "mean_runs_by_250": [round(statistics.fmean(values[i:i + 250]), 1)
                                           for i in range(0, len(values), 250)]}
        print(name, json.dumps(rows[name]))
    doc = {"settings": vars(args) | {"out": None}, "results": rows, "git": git_info(),
           "command": "PYTHONPATH=. python3 tools/probes/probe_block_runs.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
           + " --out F"}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
