"""Admission: the gateway-wide bound on requests in flight (`--max-concurrent-requests`).

Generation requests (completions, chat, responses, gRPC Generate) and embeddings requests hold
one place each from when their first worker call is about to be made until they end, however
they end (finished, failed, cancelled, the client gone mid-stream); a streamed request holds it
until its stream ends. One arriving with every place taken is refused at once, before any
worker is called: `OverloadedError` (429 with `Retry-After`, RESOURCE_EXHAUSTED on gRPC).
Requests the workers refused (every worker of a pool full) are counted here too, so that the
refused-requests metric counts each client request once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Iterator
from typing import TypeVar

from gateway.errors import OverloadedError
from gateway.metrics import GatewayMetrics

T = TypeVar("T")


class RequestLimit:
    """Requests in flight at this gateway, at most `max_concurrent` (0: no bound).

    `num_in_flight` is mutated only by `slot`, on the gateway's one event loop (no lock)."""

    def __init__(self, max_concurrent: int, metrics: GatewayMetrics) -> None:
        self.max_concurrent = max_concurrent
        self.num_in_flight = 0
        self._refused = metrics.requests_refused

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one place while the body runs; OverloadedError (before the body) when every
        place is taken. An OverloadedError out of the body is counted by its reason."""
        if self.max_concurrent and self.num_in_flight >= self.max_concurrent:
            self._refused.labels(reason="gateway_limit").inc()
            raise OverloadedError(
                "gateway_limit",
                f"overloaded: this gateway has {self.num_in_flight} requests in flight, at most "
                f"{self.max_concurrent} (--max-concurrent-requests); retry later")
        self.num_in_flight += 1
        try:
            yield
        except OverloadedError as err:
            self._refused.labels(reason=err.reason).inc()
            raise
        finally:
            self.num_in_flight -= 1

    async def admitted(self, events: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
        """`events` inside a `slot`: taken at the first `anext` (nothing of `events` has run
        yet: no worker was called), given back when they end, fail or are closed."""
        async with contextlib.aclosing(events):
            with self.slot():
                async for event in events:
                    yield event
