"""gRPC channels to prefill workers, kept across a decode worker's KV pulls and the gateway's
lease releases.

A fresh channel per call costs a connection and, under mutual TLS, a handshake: 3.24 against
0.78 ms per call on the development CPU (tools/probes/probe_channel_reuse.py,
bench/results/cpu_channel_reuse.json), and a pull makes two calls (the pull, the release).

A kept channel must not outlive its worker's trouble: gRPC waits up to minutes between
reconnection attempts by default, so these channels retry every 0.1-1 s, and a load that fails
drops its worker's channels (the next call opens new ones at once). Dropped or evicted
channels close with a grace period, so calls other loads still have on them can finish.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import grpc

from rpc.tls import internal_channel

# Reconnection backoff of a kept channel (gRPC's defaults: 1 s, growing to 120 s), and its
# own connections: gRPC otherwise shares them between channels of the same target, so a new
# channel made after a drop would inherit the old one's failed connection and its backoff.
RECONNECT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.use_local_subchannel_pool", 1),
)


class ChannelCache:
    """Channels by (worker address, channel options), least recently used evicted past
    `max_channels`. Used from one event loop (the one its channels were made on).
    `interceptors`: the client interceptors of every channel (the cluster secret's)."""

    def __init__(self, max_channels: int = 64, close_grace_s: float = 30.0,
                 interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None) -> None:
        if max_channels < 1:
            raise ValueError(f"max_channels must be >= 1, got {max_channels}")
        self._max = max_channels
        self._grace = close_grace_s
        self._interceptors = interceptors
        self._channels: OrderedDict[tuple[str, tuple[tuple[str, Any], ...]],
                                    grpc.aio.Channel] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._channels)

    def get(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """The kept channel to `address` with `options`, made on first use."""
        key = (address, tuple(options))
        channel = self._channels.get(key)
        if channel is None:
            channel = internal_channel(address, options=[*RECONNECT_OPTIONS, *options],
                                       interceptors=self._interceptors)
            self._channels[key] = channel
            while len(self._channels) > self._max:
                self._close(self._channels.popitem(last=False)[1])
        else:
            self._channels.move_to_end(key)
        return channel

    def drop(self, address: str) -> None:
        """Forget every channel to `address` (closed once their calls end, or after the grace
        period): the next `get` makes a new one."""
        for key in [k for k in self._channels if k[0] == address]:
            self._close(self._channels.pop(key))

    async def aclose(self) -> None:
        """Close every channel (waiting for the calls on them up to the grace period)."""
        while self._channels:
            self._close(self._channels.popitem()[1])
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def _close(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.ensure_future(channel.close(grace=self._grace))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
