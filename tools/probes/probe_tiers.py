"""Time to first token when a prompt's KV comes from a prefix tier (the CPU tier, Redis), against
computing it and against a GPU prefix-cache hit, and what the fetch-or-recompute cost model chose
(worker/tier_cache.py in-process: an AsyncEngine whose KV loader is a TierPrefixCache, no gRPC).

Per prompt length and repeat, with a fresh random prompt each time (the first repeat of each
length is a warm-up, not reported), one request at a time, 1 output token, in this order:
- `cold`: nothing cached, the whole prompt computed (its time feeds the cost model's prefill
  rate, as a worker's computed prefills do);
- `gpu_hit`: the same prompt again, its blocks in the GPU prefix cache;
- `cpu_tier_hit`: the GPU prefix cache reset: the full blocks come from the CPU tier;
- `redis_hit`: reset again, a Redis-only tier: the cost model splits Redis's blocks into a head
  computed while the tail is read (or fetches all, or computes all): `cost_model` says which,
  and `plan_ms` how long `plan` took (asking Redis which blocks it holds, and any fetch-all);
- `redis_fetch_all`: reset again, the same with the cost model off (every block read first).
Each is the time from before `plan` to the first token. `save_cpu_ms` / `save_redis_ms` time the
saves between (pin, read, encode, store; Redis: until its writes are acknowledged). The CPU-tier
and fetch-all hits must give the GPU hit's first token with the same logprob, bit for bit (the
same KV bits): the exit status says so. A split computes the head's KV anew (other chunking), so
on random dummy weights (near-tied logits) its token may differ; `redis_same_token` counts.

Redis: `--redis-server PATH` starts that binary (its libraries beside it: LD_LIBRARY_PATH) on a
free 127.0.0.1 port, without persistence, and stops it at the end; or `--redis-url` an existing
one (its database is flushed between prompts); neither: the Redis cases are skipped.

Usage: PYTHONPATH=. python3 tools/probes/probe_tiers.py --out F [--model dummy:llama-3.1-8b]
       [--lens 1000,4050,16050] [--repeats 3] [--cpu-tier-gb 8] [--redis-server PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator
from typing import Any

from bench import offline
from bench.results import environment_info

CASES = ("cold", "gpu_hit", "cpu_tier_hit", "redis_hit", "redis_fetch_all")


@contextlib.contextmanager
def redis_process(binary: str) -> Iterator[str]:
    """A redis-server of the probe's own on a free loopback port: yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    libs = os.path.dirname(os.path.abspath(binary))
    env["LD_LIBRARY_PATH"] = libs + (":" + env["LD_LIBRARY_PATH"]
                                     if env.get("LD_LIBRARY_PATH") else "")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"{binary} did not start: {err[-2000:]}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(timeout=15)


class Probe:
    """One engine, a CPU-tier cache and a Redis-only cache over it; the loader follows `use`."""

    def __init__(self, args: argparse.Namespace, redis_url: str | None) -> None:
        from engine.async_engine import AsyncEngine
        from kv_transfer.tiers import CpuTier, RedisTier, TieredStore
        from worker.kv import block_spec
        from worker.tier_cache import TierPrefixCache

        llm = offline.build_llm(offline.EngineSettings(
            model=args.model, dtype=args.dtype, max_model_len=max(args.lens) + 64,
            max_num_seqs=64, max_num_batched_tokens=8192, gpu_memory_utilization=0.9))
        self.engine = llm.engine
        self.aengine = AsyncEngine(self.engine)
        spec = block_spec(self.engine)
        self.cpu = TierPrefixCache(self.aengine, TieredStore(
            spec, CpuTier(int(args.cpu_tier_gb * (1 << 30)))))
        self.redis = (TierPrefixCache(self.aengine, TieredStore(
            spec, CpuTier(0), RedisTier(spec, redis_url, ttl_s=900, key_prefix="probe-tiers"),
            max_queued_bytes=64 << 30)) if redis_url else None)
        self.redis_url = redis_url
        self.use = self.cpu
        self.aengine.kv_loader = lambda load: self.use.load(load)
        self._ids = iter(range(1 << 30))
        self.last_plan_ms = 0.0  # the last `first_token`'s `plan` alone

    async def first_token(self, ids: list[int], cache: Any) -> tuple[float, tuple[int, float]]:
        """(ms to the first token from before `plan`, (token, its logprob)) through `cache`."""
        from engine import SamplingParams
        from engine_api.request_options import RequestOptions

        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
        self.use = cache
        t0 = time.perf_counter()
        remote = await cache.plan(ids)
        self.last_plan_ms = (time.perf_counter() - t0) * 1e3
        async for out in self.aengine.generate(f"p{next(self._ids)}", ids,
                                               RequestOptions(params, remote_kv=remote)):
            return ((time.perf_counter() - t0) * 1e3,
                    (out.new_token_ids[0], out.new_logprobs[0].logprob))
        raise RuntimeError("no output")

    async def reset_gpu_cache(self) -> None:
        if not await self.aengine.call(self.engine.scheduler.kv.reset_prefix_cache):
            raise RuntimeError("blocks still in use: cannot reset the prefix cache")

    async def one(self, ids: list[int]) -> dict[str, Any]:
        """The cases of one prompt (module docstring)."""
        row: dict[str, Any] = {}
        tokens: dict[str, tuple[int, float]] = {}
        row["cold"], tokens["cold"] = await self.first_token(ids, self.cpu)
        for cache in (self.cpu, self.redis):
            if cache is not None:  # the worker's own measure: the computed prefill's time
                cache.observe_prefill(len(ids), 0, row["cold"] / 1e3)
        t = time.perf_counter()
        await self.cpu.save_tokens(ids)
        row["save_cpu_ms"] = (time.perf_counter() - t) * 1e3
        if self.redis is not None:
            t = time.perf_counter()
            await self.redis.save_tokens(ids)
            await self.redis.wait_for_saves()
            row["save_redis_ms"] = (time.perf_counter() - t) * 1e3
        row["gpu_hit"], tokens["gpu_hit"] = await self.first_token(ids, self.cpu)
        await self.reset_gpu_cache()
        row["cpu_tier_hit"], tokens["cpu_tier_hit"] = await self.first_token(ids, self.cpu)
        await self.reset_gpu_cache()
        if self.redis is not None:
            cost = self.redis.cost
            redis_cost = self.redis.store.tiers[-1].cost
            row["cost_model"] = {
                "prefill_tokens_per_s": round(cost.prefill_tokens_per_s or 0.0, 1),
                "redis_latency_ms": round(redis_cost.latency_s * 1e3, 3),
                "redis_gb_per_s": round(redis_cost.bytes_per_s / 1e9, 3)}
            cost.last_split = None
            row["redis_hit"], tokens["redis_hit"] = await self.first_token(ids, self.redis)
            split = cost.last_split
            row["cost_model"]["plan_ms"] = round(self.last_plan_ms, 2)
            row["cost_model"]["blocks_computed_fetched"] = list(split) if split else None
            await self.reset_gpu_cache()
            rate, cost.prefill_tokens_per_s = cost.prefill_tokens_per_s, None  # model off
            row["redis_fetch_all"], tokens["redis_fetch_all"] = await self.first_token(
                ids, self.redis)
            cost.prefill_tokens_per_s = rate
            await self.reset_gpu_cache()
            await self._flush_redis()
        row["tokens"] = tokens
        row["tier_equals_gpu_hit"] = all(tokens[c] == tokens["gpu_hit"] for c in tokens
                                         if c in ("cpu_tier_hit", "redis_fetch_all"))
        row["redis_same_token"] = ("redis_hit" in tokens
                                   and tokens["redis_hit"][0] == tokens["gpu_hit"][0])
        return row

    async def _flush_redis(self) -> None:
        from redis import asyncio as aioredis

        assert self.redis_url is not None
        client = aioredis.Redis.from_url(self.redis_url)
        try:
            await client.flushdb()
        finally:
            await client.aclose()

    async def close(self) -> None:
        for cache in (self.cpu, self.redis):
            if cache is not None:
                await cache.close()
        await self.aengine.stop()


def _label(n: int) -> str:
    return f"{round(n / 1000)}k" if n >= 1000 else str(n)


async def _probe(args: argparse.Namespace, redis_url: str | None) -> dict[str, Any]:
    probe = Probe(args, redis_url)
    probe.aengine.start()
    vocab = probe.engine.model_config.vocab_size
    rng = random.Random(11)
    results: dict[str, Any] = {"ttft_ms": {}, "save_ms": {}, "cost_model": {}, "runs": {}}
    try:
        await probe.first_token([rng.randrange(vocab) for _ in range(256)], probe.cpu)  # warm
        for n in args.lens:
            rows = []
            for _ in range(args.repeats + 1):  # the first of each length is a warm-up
                rows.append(await probe.one([rng.randrange(vocab) for _ in range(n)]))
                print(n, {c: round(rows[-1][c]) for c in CASES if c in rows[-1]},
                      rows[-1].get("cost_model"), flush=True)
            timed, label = rows[1:], _label(n)
            results["ttft_ms"][label] = {c: round(statistics.median(r[c] for r in timed), 1)
                                         for c in CASES if c in timed[0]}
            results["save_ms"][label] = {k: round(statistics.median(r[k] for r in timed), 1)
                                         for k in ("save_cpu_ms", "save_redis_ms")
                                         if k in timed[0]}
            results["cost_model"][label] = [r.get("cost_model") for r in timed]
            results["runs"][label] = [
                {k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}
                for r in timed]
            results.setdefault("tier_equals_gpu_hit", {})[label] = all(
                r["tier_equals_gpu_hit"] for r in rows)
            results.setdefault("redis_same_token", {})[label] = sum(
                r["redis_same_token"] for r in timed)
        results["prompt_tokens"] = {_label(n): n for n in args.lens}
        results["repeats"] = args.repeats
    finally:
        await probe.close()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    # Not multiples of the block size: a full last block is computed again on a GPU hit but
    # loaded on a tier hit, and the two would then compute different tails.
    p.add_argument("--lens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1000, 4050, 16050])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-tier-gb", type=float, default=8.0)
    p.add_argument("--redis-server", default=None, help="a redis-server binary to start")
    p.add_argument("--redis-url", default=None, help="an existing Redis (flushed!)")
    args = p.parse_args()
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        url = (stack.enter_context(redis_process(args.redis_server)) if args.redis_server
               else args.redis_url)
        results = asyncio.run(_probe(args, url))
    doc = {"probe": "tiers", "command": "PYTHONPATH=. python3 tools/probes/probe_tiers.py " + " ".join(
               f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, list) else v}"
               for k, v in vars(args).items() if k != "out" and v is not None),
           "wall_s": round(time.perf_counter() - started, 1),
           "environment": environment_info(), "results": results}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: results[k] for k in ("ttft_ms", "save_ms", "tier_equals_gpu_hit",
                                              "redis_same_token")}, indent=1))
    return 0 if all(results["tier_equals_gpu_hit"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
