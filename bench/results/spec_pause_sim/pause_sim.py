"""Simulate one request under the speculation pause rule (see README.md in this folder)."""

import random


def sim(
    p: float,
    keep: float,
    restart: float,
    backoff: bool,
    floor: float = 0.4,
    k: int = 4,
    tokens: int = 2000,
    interval: int = 8,
    seed: int = 0,
    cap: int = 64,
) -> tuple[int, int]:
    """Return (decode steps, verify steps) to emit `tokens` tokens."""
    rnd = random.Random(seed)
    avg = float("inf")
    n = resume = steps = verify = 0
    cur = interval
    while n < tokens:
        steps += 1
        if n >= resume and avg < floor:
            avg = restart * floor
            resume = n + cur
            if backoff:
                cur = min(cap, cur * 2)
        if n < resume:
            n += 1
            continue
        a = 0
        while a < k and rnd.random() < p:
            a += 1
        verify += 1
        n += a + 1
        avg = a if avg == float("inf") else keep * avg + (1 - keep) * a
        if backoff and avg >= restart * floor:
            cur = interval
    return steps, verify


if __name__ == "__main__":
    for keep, restart, b in [(0.5, 1.0, False), (0.75, 1.5, False), (0.75, 1.5, True)]:
        print(keep, restart, b, [(p, sim(p, keep, restart, b)) for p in (0.0, 0.15, 0.3, 0.45, 0.6, 0.9)])
