"""Time to first token when a prompt's KV comes from the CPU tier, against computing it and
against a GPU prefix-cache hit (worker/tier_cache.py, in-process: an AsyncEngine with a
TierPrefixCache over a CPU tier as its KV loader, no gRPC).

Per prompt length and repeat, with a fresh random prompt each time:
- `cold`: nothing cached, the whole prompt computed;
- `save`: `save_tokens` of the prompt (pin, read, encode, store: what a colocated worker does
  after a request), timed on its own (it runs in the background when serving);
- `gpu_hit`: the same prompt again, its blocks in the GPU prefix cache;
- `tier_hit`: the GPU prefix cache reset, the same prompt again: its full blocks come from the
  CPU tier (`plan` + the engine's KV load), the last partial block is computed.
Each is the time from before `plan` to the first token, one request at a time, 1 output token;
`tier_plan_ms` and `tier_load_ms` split the tier hit. The tier hit must give the GPU hit's first
token with the same logprob, bit for bit (the same KV bits, the same kernels): the exit status
says so. The cold run computes the prompt's KV in other kernels, so on random dummy weights
(near-tied logits) its token may differ; `cold_same_token` reports it.

Usage: PYTHONPATH=. python3 tools/probes/probe_tiers.py --out F [--model dummy:llama-3.1-8b]
       [--lens 1000,4050] [--repeats 3] [--cpu-tier-gb 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

from bench import offline
from bench.results import environment_info


async def _probe(args: argparse.Namespace) -> dict[str, Any]:
    from engine import SamplingParams
    from engine.async_engine import AsyncEngine
    from engine_api.request_options import RequestOptions
    from kv_transfer.tiers import CpuTier, TieredStore
    from worker.kv import block_spec
    from worker.tier_cache import TierPrefixCache

    llm = offline.build_llm(offline.EngineSettings(
        model=args.model, dtype=args.dtype, max_model_len=max(args.lens) + 64,
        max_num_seqs=64, max_num_batched_tokens=8192, gpu_memory_utilization=0.9))
    engine = llm.engine
    aengine = AsyncEngine(engine)
    cache = TierPrefixCache(aengine, TieredStore(block_spec(engine),
                                                 CpuTier(int(args.cpu_tier_gb * (1 << 30)))))
    load_s: list[float] = []

    async def timed_load(load: Any) -> bool:
        t = time.perf_counter()
        ok = await cache.load(load)
        load_s.append(time.perf_counter() - t)
        return ok

    aengine.kv_loader = timed_load
    aengine.start()
    vocab = engine.model_config.vocab_size
    rng = random.Random(11)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    counter = iter(range(1 << 30))

    async def first_token(ids: list[int]) -> tuple[float, float, tuple[int, float]]:
        """(ms to the first token from before `plan`, ms in `plan`, (token, its logprob))."""
        t0 = time.perf_counter()
        remote = await cache.plan(ids)
        plan_ms = (time.perf_counter() - t0) * 1e3
        async for out in aengine.generate(f"p{next(counter)}", ids,
                                          RequestOptions(params, remote_kv=remote)):
            return ((time.perf_counter() - t0) * 1e3, plan_ms,
                    (out.new_token_ids[0], out.new_logprobs[0].logprob))
        raise RuntimeError("no output")

    results: dict[str, Any] = {}
    try:
        await first_token([rng.randrange(vocab) for _ in range(256)])  # warm-up
        for n in args.lens:
            rows: list[dict[str, Any]] = []
            for _ in range(args.repeats + 1):  # the first of each length is a warm-up
                ids = [rng.randrange(vocab) for _ in range(n)]
                cold, _, tok_cold = await first_token(ids)
                t = time.perf_counter()
                saved = await cache.save_tokens(ids)
                save_ms = (time.perf_counter() - t) * 1e3
                gpu, _, tok_gpu = await first_token(ids)
                if not await aengine.call(engine.scheduler.kv.reset_prefix_cache):
                    raise RuntimeError("blocks still in use: cannot reset the prefix cache")
                before = cache.stats.loaded_blocks
                load_s.clear()
                tier, plan_ms, tok_tier = await first_token(ids)
                rows.append({
                    "cold_ms": cold, "save_ms": save_ms, "gpu_hit_ms": gpu, "tier_hit_ms": tier,
                    "tier_plan_ms": plan_ms, "tier_load_ms": sum(load_s) * 1e3,
                    "saved_blocks": saved, "loaded_blocks": cache.stats.loaded_blocks - before,
                    "tokens": {"cold": tok_cold, "gpu_hit": tok_gpu, "tier_hit": tok_tier},
                    "tier_equals_gpu_hit": tok_tier == tok_gpu,
                    "cold_same_token": tok_cold[0] == tok_gpu[0]})
            timed = rows[1:]
            summary = {key: round(statistics.median(r[key] for r in timed), 2)
                       for key in ("cold_ms", "save_ms", "gpu_hit_ms", "tier_hit_ms",
                                   "tier_plan_ms", "tier_load_ms")}
            summary.update(prompt_tokens=n, loaded_blocks=timed[0]["loaded_blocks"],
                           saved_blocks=timed[0]["saved_blocks"],
                           tier_equals_gpu_hit=all(r["tier_equals_gpu_hit"] for r in rows),
                           cold_same_token=sum(r["cold_same_token"] for r in timed),
                           kv_bytes_loaded=timed[0]["loaded_blocks"] * cache._spec.block_nbytes,
                           runs=[{k: round(v, 2) if isinstance(v, float) else v
                                  for k, v in r.items()} for r in timed])
            results[f"len_{n}"] = summary
            print(n, json.dumps({k: v for k, v in summary.items() if k != "runs"}), flush=True)
        cpu = cache.store.cpu
        slots = getattr(cpu, "slots", None)  # absent before the CPU tier had slots
        results["cpu_tier"] = {"used_bytes": cpu.used_bytes, "entries": len(cpu),
                               "pinned_slab_bytes": slots.reserved_bytes if slots else None}
        print("cpu tier", json.dumps(results["cpu_tier"]), flush=True)
    finally:
        await aengine.stop()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    # Not multiples of the block size: a full last block is computed again on a GPU hit but
    # loaded on a tier hit, and the two would then compute different tails.
    p.add_argument("--lens", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 4050])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-tier-gb", type=float, default=4.0)
    args = p.parse_args()
    results = asyncio.run(_probe(args))
    doc = {"probe": "tiers", "command": "PYTHONPATH=. python3 tools/probes/probe_tiers.py " + " ".join(
               f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, list) else v}"
               for k, v in vars(args).items() if k != "out"),
           "environment": environment_info(), "results": results}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0 if all(r["tier_equals_gpu_hit"] for k, r in results.items() if k != "cpu_tier") else 1


if __name__ == "__main__":
    raise SystemExit(main())
