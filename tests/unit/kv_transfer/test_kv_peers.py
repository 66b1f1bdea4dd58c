"""`--kv-peers`: which addresses a KV handle may name (kv_transfer/peers.py)."""

from __future__ import annotations

import asyncio

import pytest

from kv_transfer.peers import KvPeers


def _refusal(peers: KvPeers, address: str) -> str | None:
    return asyncio.run(peers.refusal(address))


def test_entries_allow_their_addresses_only() -> None:
    peers = KvPeers(["10.0.0.5:50061", "10.1.0.0/16", "[fd00::7]:50061", "10.2.0.9",
                     "dns:///localhost:50061"])
    for allowed in ("10.0.0.5:50061", "10.1.200.3:9", "[fd00::7]:50061", "10.2.0.9:1234",
                    "127.0.0.1:50061", "localhost:50061"):
        assert _refusal(peers, allowed) is None, allowed
    for refused in ("10.0.0.5:50062", "10.0.0.6:50061", "10.3.0.1:50061", "[fd00::8]:50061",
                    "127.0.0.1:50062", "evil.example:50061", "no port here:"):
        assert _refusal(peers, refused) is not None, refused


@pytest.mark.parametrize("entry", ["10.0.0.0/33", "host:0", "host:x", "[fd00::1", ":50061"])
def test_malformed_entries_are_refused_at_start(entry: str) -> None:
    with pytest.raises(ValueError):
        KvPeers([entry])


def test_an_empty_list_is_an_error() -> None:
    with pytest.raises(ValueError, match="no KV peer"):
        KvPeers([" ", ""])
