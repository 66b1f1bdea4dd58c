"""Prefix tiers on the CPU with SmolLM2 (the embedded default model): TTFT cold vs GPU-cache hit
vs CPU-tier hit vs Redis hit, fresh-process Redis hits under load, and a multi-turn chat
workload with the tiers on and off. Writes bench/results/cpu_tiers.json.

In-process engines (an AsyncEngine with TierPrefixCache as its KV loader, as a worker has; no
gRPC), a redis-server of the probe's own on a free loopback port.

- ttft_ms: per length, per repeat with a fresh random prompt, in this order (interleaved):
  `cold` (nothing cached), `gpu_hit` (the same prompt again), `cpu_tier_hit` (the GPU prefix
  cache reset: the CPU tier's blocks), `redis_hit` (reset again, a Redis-only tier: Redis's
  blocks). Time from before `plan` to the first token; medians over the repeats.
- redis_hits_fresh_process: 5 prompts of 1,559 tokens, each under its own cache salt, saved to
  Redis by this process; then a new process (a new engine: nothing in memory) asks for the five
  concurrently with two other prompts of 1,559 tokens computing beside them: "k/n" of the five
  loaded their full blocks from Redis.
- multiturn_tok_s_tiers_on/off: 4 conversations, 3 turns each (a 400-token opening, then 64 user
  tokens and a 16-token answer per turn), the conversations concurrent within a turn, on an
  engine whose KV cache holds about 3/4 of them (so the GPU cache evicts); generated tokens per
  second over the workload, runs on and off alternated, medians.

Usage: PYTHONPATH=. python3 tools/probes/probe_tiers_cpu.py [--out bench/results/cpu_tiers.json]
       [--repeats 3] [--lens 1000,4000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.results import environment_info
from tests.support.redis_server import RedisServer

FRESH_LEN = 1559  # the new user's prompt (--fresh-len)
_REQUEST_IDS = iter(range(1 << 30))  # one engine, many runners: ids unique per process
SALTS = [f"user-{i}" for i in range(5)]


def _engine(num_blocks: int, max_model_len: int) -> Any:
    from engine.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(
        cache=CacheConfig(block_size=16, num_gpu_blocks=num_blocks),
        scheduler=SchedulerConfig(role="colocated", max_model_len=max_model_len),
        runner=RunnerConfig(device="cpu")), detokenize=False)


def _tiers(aengine: Any, cpu_bytes: int, url: str | None, prefix: str) -> Any:
    from worker.tier_cache import TierConfig, TierPrefixCache

    return TierPrefixCache.from_config(aengine, TierConfig(
        cpu_bytes=cpu_bytes, redis_url=url, redis_key_prefix=prefix, redis_ttl_s=600))


class Runner:
    """First tokens and short generations through one engine and its tier caches."""

    def __init__(self, aengine: Any) -> None:
        from engine import SamplingParams

        self.aengine = aengine
        self._params = SamplingParams
        self.planned = 0

    async def generate(self, ids: list[int], tiers: Any | None, max_tokens: int = 1,
                       salt: str | None = None, save: bool = False) -> tuple[float, list[int]]:
        """(ms from before `plan` to the first token, the tokens); `save`: the tiers save the
        prompt and output behind it, as a colocated worker does. `self.planned`: the tokens
        the last plan took from the tiers."""
        from engine_api.request_options import RequestOptions

        engine = self.aengine.engine
        root = engine.hash_root(None, salt) if salt else None
        t0 = time.perf_counter()
        remote = await tiers.plan(ids, root) if tiers is not None else None
        self.planned = remote.num_tokens if remote is not None else 0
        first, tokens = 0.0, []
        params = self._params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async for out in self.aengine.generate(f"r{next(_REQUEST_IDS)}", ids, RequestOptions(
                params, remote_kv=remote, cache_salt=salt)):
            first = first or (time.perf_counter() - t0) * 1e3
            tokens.extend(out.new_token_ids)
        if save and tiers is not None:
            tiers.spawn_save_tokens([*ids, *tokens][:-1], root)
        return first, tokens

    async def reset_gpu_cache(self) -> None:
        engine = self.aengine.engine
        if not await self.aengine.call(engine.scheduler.kv.reset_prefix_cache):
            raise RuntimeError("blocks still in use: cannot reset the prefix cache")


async def _ttft(args: argparse.Namespace, url: str) -> dict[str, Any]:
    from engine.async_engine import AsyncEngine

    engine = _engine(num_blocks=max(args.lens) // 16 + 64, max_model_len=max(args.lens) + 64)
    aengine = AsyncEngine(engine)
    cpu = _tiers(aengine, 1 << 30, None, "unused")
    redis = _tiers(aengine, 0, url, "probe-ttft")
    aengine.kv_loader = cpu.load  # loads any tier's plan
    aengine.start()
    run = Runner(aengine)
    rng = random.Random(7)
    vocab = engine.model_config.vocab_size
    rows: dict[int, dict[str, list[float]]] = {n: {} for n in args.lens}
    same: list[bool] = []
    splits: dict[int, list[Any]] = {}
    try:
        await run.generate([rng.randrange(vocab) for _ in range(256)], None)  # warm-up
        for _ in range(args.repeats):
            for n in args.lens:  # lengths alternate within each repeat
                ids = [rng.randrange(vocab) for _ in range(n)]
                cold, tok = await run.generate(ids, cpu)
                redis.observe_prefill(n, 0, cold / 1e3)  # the cost model's rate, as a worker's
                await cpu.save_tokens(ids)
                await redis.save_tokens(ids)
                await redis.wait_for_saves()
                gpu, tok_gpu = await run.generate(ids, cpu)
                await run.reset_gpu_cache()
                cpu_hit, tok_cpu = await run.generate(ids, cpu)
                await run.reset_gpu_cache()
                redis.cost.last_split = None
                redis_hit, tok_redis = await run.generate(ids, redis)
                splits.setdefault(n, []).append(redis.cost.last_split)
                await run.reset_gpu_cache()
                same.append(tok == tok_gpu == tok_cpu == tok_redis)
                for case, ms in (("cold", cold), ("gpu_cache_hit", gpu),
                                 ("cpu_tier_hit", cpu_hit), ("redis_hit", redis_hit)):
                    rows[n].setdefault(case, []).append(ms)
                print(n, {k: round(v[-1]) for k, v in rows[n].items()}, flush=True)
    finally:
        await cpu.close()
        await redis.close()
        await aengine.stop()
    return {"ttft_ms": {f"{n // 1000}k" if n % 1000 == 0 else str(n): {
                case: round(statistics.median(v), 1) for case, v in cases.items()}
                        for n, cases in rows.items()},
            "ttft_runs_ms": {str(n): {c: [round(x, 1) for x in v] for c, v in cases.items()}
                             for n, cases in rows.items()},
            "same_first_token_every_case": all(same),
            "redis_hit_blocks_computed_fetched": {str(n): v for n, v in splits.items()},
            "redis_loaded_blocks": redis.stats.loaded_blocks}


def _fresh_prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(3)
    shared = [rng.randrange(vocab) for _ in range(FRESH_LEN)]
    others = [[rng.randrange(vocab) for _ in range(FRESH_LEN)] for _ in range(2)]
    return [shared] * len(SALTS), others


async def _seed_fresh(url: str) -> None:
    """Save the five salted prompts to Redis from this process."""
    from engine.async_engine import AsyncEngine

    engine = _engine(num_blocks=FRESH_LEN // 16 * 6 + 64, max_model_len=FRESH_LEN + 64)
    aengine = AsyncEngine(engine)
    redis = _tiers(aengine, 0, url, "probe-fresh")
    aengine.kv_loader = redis.load
    aengine.start()
    try:
        prompts, _ = _fresh_prompts(engine.model_config.vocab_size)
        run = Runner(aengine)
        await asyncio.gather(*(run.generate(ids, redis, salt=salt, save=True)
                               for ids, salt in zip(prompts, SALTS, strict=True)))
        await redis.wait_for_saves()
    finally:
        await redis.close()
        await aengine.stop()


async def _fresh_child(url: str) -> dict[str, Any]:
    """In a new process: the five salted prompts under concurrent load; how many hit Redis."""
    from engine.async_engine import AsyncEngine

    engine = _engine(num_blocks=FRESH_LEN // 16 * 8 + 64, max_model_len=FRESH_LEN + 64)
    aengine = AsyncEngine(engine)
    redis = _tiers(aengine, 256 << 20, url, "probe-fresh")
    aengine.kv_loader = redis.load
    aengine.start()
    try:
        prompts, others = _fresh_prompts(engine.model_config.vocab_size)
        run = Runner(aengine)

        async def one(ids: list[int], salt: str) -> bool:
            each = Runner(aengine)
            await each.generate(ids, redis, max_tokens=8, salt=salt)
            return each.planned == FRESH_LEN // 16 * 16

        load = [run.generate(ids, None, max_tokens=8) for ids in others]
        hits = await asyncio.gather(*(one(ids, s) for ids, s in zip(prompts, SALTS, strict=True)),
                                    *load)
        k = sum(1 for h in hits[:len(SALTS)] if h is True)
        store = redis.store.redis
        return {"hits": k, "n": len(SALTS), "read_errors": dict(store.counters.read_errors)}
    finally:
        await redis.close()
        await aengine.stop()


async def _multiturn(url: str, tiers_on: bool, seed: int, opening: int) -> float:
    from engine.async_engine import AsyncEngine

    user, answer, convs, turns = 64, 16, 4, 3
    final = opening + turns * (user + answer)
    engine = _engine(num_blocks=int(convs * final / 16 * 0.75), max_model_len=final + 64)
    aengine = AsyncEngine(engine)
    tiers = _tiers(aengine, 1 << 30, url, f"probe-multiturn-{seed}") if tiers_on else None
    if tiers is not None:
        aengine.kv_loader = tiers.load
    aengine.start()
    run = Runner(aengine)
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    history = [[rng.randrange(vocab) for _ in range(opening)] for _ in range(convs)]
    generated = 0
    try:
        start = time.perf_counter()
        for _ in range(turns):
            outs = await asyncio.gather(*(run.generate(h, tiers, max_tokens=answer, save=True)
                                          for h in history))
            for h, (_, tokens) in zip(history, outs, strict=True):
                generated += len(tokens)
                h.extend(tokens)
                h.extend(rng.randrange(vocab) for _ in range(user))
        elapsed = time.perf_counter() - start
    finally:
        if tiers is not None:
            await tiers.close()
        await aengine.stop()
    return generated / elapsed


def main() -> int:
    global FRESH_LEN  # the child process takes it from --fresh-len as well
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/cpu_tiers.json")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lens", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 4000])
    p.add_argument("--fresh-len", type=int, default=FRESH_LEN,
                   help="tokens of the fresh-process prompts")
    p.add_argument("--turn-opening", type=int, default=400,
                   help="multi-turn: tokens of each conversation's opening")
    p.add_argument("--ttft-only", action="store_true",
                   help="the TTFT table alone (the other phases in another invocation)")
    p.add_argument("--merge", action="store_true",
                   help="keep what --out holds, replacing only what this run measures")
    p.add_argument("--turn-repeats", type=int, default=3,
                   help="multi-turn: runs with tiers on and off each (alternated)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the fresh process: url
    args = p.parse_args()
    FRESH_LEN = args.fresh_len
    if args.child:
        print(json.dumps(asyncio.run(_fresh_child(args.child))))
        return 0
    command = ("PYTHONPATH=. python3 tools/probes/probe_tiers_cpu.py --repeats "
               f"{args.repeats} --lens {','.join(map(str, args.lens))} --fresh-len "
               f"{args.fresh_len} --turn-opening {args.turn_opening} --turn-repeats "
               f"{args.turn_repeats}" + (" --ttft-only" if args.ttft_only else ""))
    doc: dict[str, Any] = {}
    if args.merge:
        with open(args.out) as f:
            doc = json.load(f)
    commands = doc.get("commands", [])
    doc.update({
        "commands": [*commands, command] if args.merge else [command],
        "note": ("CPU (2 cores, a machine shared with other helpers' jobs, each heavy job under "
                 "one lock); cases interleaved per repeat and reported as medians. Redis: a "
                 "redis-server of the probe's own on loopback."),
        "environment": environment_info()})
    doc.pop("command", None)

    def save() -> None:  # after each phase: a later failure keeps what was measured
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)

    server = RedisServer()
    server.start()
    try:
        if args.repeats:  # 0: the other phases alone
            doc.update(asyncio.run(_ttft(args, server.url)))
            save()
        if args.ttft_only:
            return 0 if doc.get("same_first_token_every_case", True) else 1
        asyncio.run(_seed_fresh(server.url))
        child = subprocess.run([sys.executable, __file__, "--child", server.url,
                                "--fresh-len", str(FRESH_LEN)],
                               capture_output=True, text=True, timeout=900, check=False)
        lines = [x for x in child.stdout.splitlines() if x.startswith("{")]
        if lines:  # printed before any trouble at the child's exit
            fresh = json.loads(lines[-1])
            doc["redis_hits_fresh_process"] = f"{fresh['hits']}/{fresh['n']}"
            doc["redis_fresh_process_read_errors"] = fresh["read_errors"]
        else:
            doc["redis_hits_fresh_process_error"] = (
                f"the fresh process exited {child.returncode}: {child.stderr[-2000:]}")
        if child.returncode:
            doc["fresh_process_exit_code"] = child.returncode
        save()
        on: list[float] = []
        off: list[float] = []
        for seed in range(args.turn_repeats):  # on, off, on, off, ...
            on.append(asyncio.run(_multiturn(server.url, True, seed, args.turn_opening)))
            off.append(asyncio.run(_multiturn(server.url, False, seed, args.turn_opening)))
            print("multiturn", on[-1], off[-1], flush=True)
    finally:
        server.stop()
    doc["multiturn_tok_s_tiers_on"] = round(statistics.median(on), 2)
    doc["multiturn_tok_s_tiers_off"] = round(statistics.median(off), 2)
    doc["multiturn_runs_tok_s"] = {"on": [round(x, 2) for x in on],
                                   "off": [round(x, 2) for x in off]}
    save()
    print(json.dumps({k: v for k, v in doc.items() if k not in ("environment", "ttft_runs_ms")},
                     indent=1))
    return 0 if doc.get("same_first_token_every_case", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
