"""Fuzzing the workers' gRPC services with real servers: random bytes, truncated and
bit-flipped serializations of valid requests, and forged KV handles (an unknown lease, another
worker's address, wrong block hashes, a wrong cache salt).

A case passes when the worker answers with a status (any but INTERNAL / UNKNOWN, which would
be an unhandled error) or a well-formed stream within its deadline, and stays up. The forged
handle naming an address nobody configured records whether the decode worker dialled it
(`dialled_unconfigured_address`): false when the decode worker runs with `--kv-peers` (as
`splitserve bench faults` starts it), which refuses such a handle before any connection.
Used by `splitserve bench faults` and tests/e2e/test_e2e_fuzz.py.
"""

from __future__ import annotations

import random
import socket
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from protos.splitserve.v1 import common_pb2, decode_pb2, kv_transfer_pb2, prefill_pb2

BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
Metadata = tuple[tuple[str, str], ...]
CALL_TIMEOUT_S = 5.0
# (method, unary or stream, a valid request to truncate and mutate)
_SEED_PROMPT = [504, 3575, 282, 4649, 314, 260, 1003, 28, 17]
_GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=2)
METHODS: dict[str, tuple[str, bytes]] = {
    "/splitserve.v1.Prefill/Prefill": ("unary", prefill_pb2.PrefillRequest(
        request_id="fuzz", prompt_token_ids=_SEED_PROMPT, sampling=_GREEDY).SerializeToString()),
    "/splitserve.v1.Prefill/GetLoad": ("unary", common_pb2.LoadRequest().SerializeToString()),
    "/splitserve.v1.Decode/Decode": ("stream", decode_pb2.DecodeRequest(
        request_id="fuzz", prompt_token_ids=_SEED_PROMPT, sampling=_GREEDY).SerializeToString()),
    "/splitserve.v1.KvTransfer/Release": ("unary", kv_transfer_pb2.ReleaseRequest(
        request_id="fuzz").SerializeToString()),
    "/splitserve.v1.KvTransfer/PullBlocks": ("stream", kv_transfer_pb2.PullBlocksRequest(
        request_id="fuzz", first_block=0).SerializeToString()),
}


@dataclass
class FuzzReport:
    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    dialled_unconfigured_address: bool | None = None

    def summary(self) -> dict[str, object]:
        return {"cases": self.cases, "outcomes": dict(self.outcomes),
                "failures": len(self.failures), "failure_examples": self.failures[:5],
                "dialled_unconfigured_address": self.dialled_unconfigured_address}


def _mutations(seed: bytes, rng: random.Random) -> list[bytes]:
    """Random bytes, every kind of truncation, bit flips of `seed`."""
    out = [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))]
    if seed:
        out.append(seed[:rng.randint(0, len(seed) - 1)])
        flipped = bytearray(seed)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(flipped))
            flipped[i] ^= 1 << rng.randrange(8)
        out.append(bytes(flipped))
    return out


def _call(channel: grpc.Channel, method: str, kind: str, payload: bytes,
          metadata: Metadata) -> str:
    """The outcome's name: "OK" or the status code's name."""
    try:
        if kind == "unary":
            channel.unary_unary(method)(payload, timeout=CALL_TIMEOUT_S, metadata=metadata)
        else:
            for _ in channel.unary_stream(method)(payload, timeout=CALL_TIMEOUT_S,
                                                  metadata=metadata):
                pass
    except grpc.RpcError as err:
        return str(err.code().name)  # type: ignore[attr-defined]
    return "OK"


def fuzz_worker(address: str, rounds: int, seed: int, report: FuzzReport,
                alive: Callable[[], bool] = lambda: True, metadata: Metadata = ()) -> None:
    """`rounds` x every method x every mutation against the worker at `address` (`metadata`:
    the cluster's credential, when the workers require one)."""
    rng = random.Random(seed)
    with grpc.insecure_channel(address) as channel:
        for _ in range(rounds):
            for method, (kind, valid) in METHODS.items():
                for payload in _mutations(valid, rng):
                    outcome = _call(channel, method, kind, payload, metadata)
                    _record(report, f"{method} {payload[:24].hex()}", outcome, alive)


def _record(report: FuzzReport, case: str, outcome: str, alive: Callable[[], bool]) -> None:
    report.cases += 1
    report.outcomes[outcome] += 1
    if outcome in {c.name for c in BAD_CODES} or not alive():
        report.failures.append(f"{case}: {outcome}{'' if alive() else ' (worker died)'}")


def fuzz_forged_handles(prefill: str, decode: str, report: FuzzReport,
                        alive: Callable[[], bool] = lambda: True,
                        metadata: Metadata = ()) -> None:
    """Decode calls carrying a real prefill's handle, forged four ways."""
    with grpc.insecure_channel(prefill) as p, grpc.insecure_channel(decode) as d:
        prefill_call = p.unary_unary("/splitserve.v1.Prefill/Prefill",
                                     response_deserializer=prefill_pb2.PrefillResponse.FromString)
        decode_call = d.unary_stream("/splitserve.v1.Decode/Decode",
                                     request_serializer=decode_pb2.DecodeRequest.SerializeToString)
        listener = _Listener()
        try:
            for name, forge in _forgeries(listener.address).items():
                real = prefill_call(prefill_pb2.PrefillRequest(
                    request_id=f"forge-{name}", prompt_token_ids=_SEED_PROMPT,
                    sampling=_GREEDY).SerializeToString(), timeout=30, metadata=metadata)
                request = decode_pb2.DecodeRequest(
                    request_id=f"forge-{name}", prompt_token_ids=_SEED_PROMPT, sampling=_GREEDY,
                    output_token_ids=[real.first_token_id], kv_handle=real.kv_handle)
                forge(request)
                try:
                    list(decode_call(request, timeout=30, metadata=metadata))
                    outcome = "OK"
                except grpc.RpcError as err:
                    outcome = str(err.code().name)  # type: ignore[attr-defined]
                _record(report, f"forged handle: {name}", outcome, alive)
                p.unary_unary("/splitserve.v1.KvTransfer/Release")(
                    kv_transfer_pb2.ReleaseRequest(request_id=real.kv_handle.request_id
                                                   ).SerializeToString(), timeout=10,
                    metadata=metadata)
        finally:
            report.dialled_unconfigured_address = listener.close()


def _forgeries(foreign: str) -> dict[str, Callable[[decode_pb2.DecodeRequest], None]]:
    def unknown_lease(r: decode_pb2.DecodeRequest) -> None:
        r.kv_handle.request_id = "no-such-lease"

    def other_address(r: decode_pb2.DecodeRequest) -> None:
        r.kv_handle.worker_address = foreign

    def wrong_hashes(r: decode_pb2.DecodeRequest) -> None:
        if r.kv_handle.block_hashes:
            r.kv_handle.block_hashes[0] = bytes(32)
        r.kv_handle.prompt_hash = bytes(32)

    def wrong_salt(r: decode_pb2.DecodeRequest) -> None:
        r.cache_salt = "another-tenant"

    return {"unknown_lease": unknown_lease, "other_address": other_address,
            "wrong_hashes": wrong_hashes, "wrong_salt": wrong_salt}


class _Listener:
    """A loopback port nobody configured; remembers whether anything connected to it."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self.connected = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            self.connected = True
            conn.close()

    def close(self) -> bool:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()
        return self.connected
