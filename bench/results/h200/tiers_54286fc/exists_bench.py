"""The client cost of asking Redis which blocks it holds (redis-py, local Redis at
127.0.0.1:6379/13): one pipelined EXISTS per key against one multi-key EXISTS, 1,003 keys.

Run: .venv/bin/python exists_bench.py
"""

import asyncio
import os
import time

from redis import asyncio as aioredis


async def main() -> None:
    r = aioredis.Redis.from_url("redis://127.0.0.1:6379/13")
    keys = [b"splitserve:kv:" + os.urandom(16) for _ in range(1003)]
    async with r.pipeline(transaction=False) as p:
        for k in keys:
            p.set(k, b"x")
        await p.execute()
    for _ in range(5):
        t = time.perf_counter()
        async with r.pipeline(transaction=False) as p:
            for k in keys:
                p.exists(k)
            rep = await p.execute(raise_on_error=False)
        t1 = time.perf_counter()
        n = await r.exists(*keys)
        t2 = time.perf_counter()
        print(f"pipeline {1e3 * (t1 - t):.1f} ms, one EXISTS {1e3 * (t2 - t1):.1f} ms", sum(rep), n)
    await r.flushdb()
    await r.aclose()


if __name__ == "__main__":
    asyncio.run(main())
