"""A bounded mixed load on a gateway's REST API for fault and soak runs (bench/faults.py):
greedy streams and non-streams whose text is checked against a reference run, streams the
client cancels after two events, long prompts, and structured outputs (json_object).

Every request is classified by what the client saw: "ok", an HTTP status ("429", "503"),
"stream_error" (an error event mid-stream), "connect" (no connection: the gateway is down),
"timeout"; "cancelled" for the client's own cancels. A greedy answer that differs from the
reference counts as `mismatched` (a wrong token served).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

GREEDY_PROMPTS = ("The ocean is", "A small robot walked into", "Honey bees make",
                  "Prime numbers are", "The old library held")
LONG_PROMPT = "Read these notes.\n" + "\n".join(
    f"{j}. A fact about lighthouses number {j * 7}." for j in range(60)) + "\nSummary:"
KINDS = ("greedy_stream", "greedy", "cancel", "long", "structured")
MAX_TOKENS = 24


@dataclass
class LoadStats:
    """What one stretch of load saw; `first_ok_after(t)`: the recovery time after a fault."""

    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    mismatched: int = 0
    ok_times: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each ok

    def first_ok_after(self, t: float) -> float | None:
        """Seconds from `t` to the end of the first ok request started at or after `t`."""
        ends = [end for start, end in self.ok_times if start >= t]
        return min(ends) - t if ends else None

    def summary(self) -> dict[str, Any]:
        failed = {k: v for k, v in self.outcomes.items() if k not in ("ok", "cancelled")}
        return {"sent": self.sent, "completed": self.outcomes["ok"],
                "cancelled_by_client": self.outcomes["cancelled"], "failed": failed,
                "mismatched_tokens": self.mismatched}


class LoadMix:
    """`concurrency` clients, each sending the kinds in turn until `stop` is set."""

    def __init__(self, rest_url: str, model: str, concurrency: int = 4,
                 timeout_s: float = 120.0) -> None:
        self.rest_url = rest_url.rstrip("/")
        self.model = model
        self.concurrency = concurrency
        self.timeout = httpx.Timeout(timeout_s, connect=3.0)
        self.reference: dict[str, str] = {}

    async def take_reference(self) -> None:
        """The greedy texts every later greedy answer must equal (run on a healthy stack)."""
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            for prompt in GREEDY_PROMPTS:
                r = await client.post(f"{self.rest_url}/v1/completions",
                                      json=self._body(prompt, MAX_TOKENS))
                r.raise_for_status()
                self.reference[prompt] = r.json()["choices"][0]["text"]

    async def run(self, stop: asyncio.Event, stats: LoadStats) -> None:
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            await asyncio.gather(*(self._client(client, i, stop, stats)
                                   for i in range(self.concurrency)))

    async def _client(self, client: httpx.AsyncClient, index: int, stop: asyncio.Event,
                      stats: LoadStats) -> None:
        kinds = itertools.islice(itertools.cycle(KINDS), index, None)
        for n, kind in enumerate(kinds):
            if stop.is_set():
                return
            stats.sent += 1
            start = time.monotonic()
            try:
                outcome = await self._one(client, kind, GREEDY_PROMPTS[n % len(GREEDY_PROMPTS)],
                                          stats)
            except httpx.ConnectError:
                outcome = "connect"
                await asyncio.sleep(0.2)  # the gateway is down: do not spin
            except httpx.TimeoutException:
                outcome = "timeout"
            except (httpx.HTTPError, json.JSONDecodeError, KeyError):
                outcome = "stream_error"
            stats.outcomes[outcome] += 1
            if outcome == "ok":
                stats.ok_times.append((start, time.monotonic()))
            elif outcome not in ("cancelled",):
                await asyncio.sleep(0.1)

    async def _one(self, client: httpx.AsyncClient, kind: str, prompt: str,
                   stats: LoadStats) -> str:
        url = f"{self.rest_url}/v1/completions"
        if kind == "greedy":
            r = await client.post(url, json=self._body(prompt, MAX_TOKENS))
            if r.status_code != 200:
                return str(r.status_code)
            self._check(prompt, r.json()["choices"][0]["text"], stats)
            return "ok"
        if kind == "long":
            r = await client.post(url, json=self._body(LONG_PROMPT, 8))
            return "ok" if r.status_code == 200 else str(r.status_code)
        if kind == "structured":
            body = self._body(prompt, 16) | {"response_format": {"type": "json_object"}}
            r = await client.post(url, json=body)
            return "ok" if r.status_code == 200 else str(r.status_code)
        body = self._body(prompt, MAX_TOKENS if kind == "greedy_stream" else 200) | {
            "stream": True}
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return str(r.status_code)
            text, events = [], 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "stream_error"
                text.append(event["choices"][0]["text"])
                events += 1
                if kind == "cancel" and events >= 2:
                    return "cancelled"  # leaving the block hangs up mid-stream
        self._check(prompt, "".join(text), stats)
        return "ok"

    def _check(self, prompt: str, text: str, stats: LoadStats) -> None:
        want = self.reference.get(prompt)
        if want is not None and text != want:
            stats.mismatched += 1

    def _body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
