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

Usage: PYTHONPATH=. python3 bench/probe_block_runs.py --out F [--num-blocks 19670]
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


class LruOrderPool(BlockPool):
    """The pool before d29ac28: new blocks in the order the free queue gave them."""

    def get_new_blocks(self, n: int) -> list[Block]:
        order = [b.block_id for _, b in zip(range(n), self.free_queue, strict=False)]
        blocks = {b.block_id: b for b in super().get_new_blocks(n)}
        return [blocks[i] for i in order]


def runs(ids: list[int]) -> int:
    """Maximal runs of ascending consecutive ids (what one 2-D copy moves, one side)."""
    return sum(1 for i, b in enumerate(ids) if i == 0 or b != ids[i - 1] + 1)


@dataclass
class Live:
    blocks: list[Block]
    tokens: int
    remaining: int
    extra: list[Block] = field(default_factory=list)


def simulate(pool: BlockPool, args: argparse.Namespace) -> list[int]:
    """→ the runs of each pulled prompt, in arrival order."""
    rng = random.Random(args.seed)
    bs = args.block_size
    live: list[Live] = []
    out: list[int] = []
    arrivals = 0

    # Room kept for the running requests' growth, as a scheduler admits only what fits.
    reserve = args.concurrency * -(-args.max_output // bs)
    next_prompt = rng.randint(args.min_prompt, args.max_prompt)

    def admit() -> None:
        nonlocal arrivals, next_prompt
        while (len(live) < args.concurrency and arrivals < args.requests
               and pool.num_free_blocks >= -(-next_prompt // bs) + reserve):
            blocks = pool.get_new_blocks(-(-next_prompt // bs))
            out.append(runs([b.block_id for b in blocks]))
            live.append(Live(blocks, next_prompt, rng.randint(args.min_output, args.max_output)))
            arrivals += 1
            next_prompt = rng.randint(args.min_prompt, args.max_prompt)

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
        values = simulate(make(), args)
        # The first `concurrency` pulls come from a fresh pool: the steady state is after.
        rows[name] = {"seconds": round(time.perf_counter() - start, 2),  # pool + simulation
                      "first_pulls": summary(values[:args.concurrency], 0),
                      "steady": summary(values, args.concurrency),
                      # mean runs per window of 250 pulls: how fast a fresh pool fragments
                      "mean_runs_by_250": [round(statistics.fmean(values[i:i + 250]), 1)
                                           for i in range(0, len(values), 250)]}
        print(name, json.dumps(rows[name]))
    doc = {"settings": vars(args) | {"out": None}, "results": rows, "git": git_info(),
           "command": "PYTHONPATH=. python3 bench/probe_block_runs.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
           + " --out F"}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
