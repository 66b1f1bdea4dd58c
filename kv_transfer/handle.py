"""What a KV load is given and what it reports: the `KvHandle` naming a prefill worker's leased
blocks, and the `LoadResult` of pulling them."""

from __future__ import annotations

from dataclasses import dataclass

from engine_api.hashing import HASH_BYTES
from kv_transfer.protocol import num_blocks_for
from protos.splitserve.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class KvHandle:
    """Where a request's prompt KV is held (mirror of `splitserve.v1.KvHandle`)."""

    worker_address: str          # host:port of the prefill worker's KvTransfer service
    request_id: str              # key of the lease there
    num_tokens: int              # prompt tokens whose KV is held
    num_blocks: int              # full blocks + the last partial one
    fingerprint: bytes           # model fingerprint the KV was computed under
    block_size: int
    block_hashes: tuple[bytes, ...] = ()   # hashes of the full blocks
    lease_deadline_unix_ms: int = 0
    prompt_hash: bytes = b""     # engine_api.hashing.prompt_hash of the whole prompt (b"": unset)
    lease_ticket: str = ""       # what this lease's KV calls carry (rpc/auth.py LeaseTickets)

    @classmethod
    def from_proto(cls, msg: common_pb2.KvHandle) -> KvHandle:
        """Raises ValueError naming the field when the handle is not self-consistent."""
        handle = cls(msg.worker_address, msg.request_id, msg.num_tokens, msg.num_blocks,
                     bytes(msg.fingerprint), msg.block_size, tuple(msg.block_hashes),
                     msg.lease_deadline_unix_ms, bytes(msg.prompt_hash), msg.lease_ticket)
        handle.validate()
        return handle

    def to_proto(self) -> common_pb2.KvHandle:
        return common_pb2.KvHandle(
            worker_address=self.worker_address, request_id=self.request_id,
            block_hashes=list(self.block_hashes), num_tokens=self.num_tokens,
            num_blocks=self.num_blocks, lease_deadline_unix_ms=self.lease_deadline_unix_ms,
            fingerprint=self.fingerprint, block_size=self.block_size,
            prompt_hash=self.prompt_hash, lease_ticket=self.lease_ticket)

    def validate(self) -> None:
        if not self.worker_address or not self.request_id:
            raise ValueError("KvHandle.worker_address and KvHandle.request_id must be set")
        if self.num_tokens <= 0 or self.block_size <= 0:
            raise ValueError("KvHandle.num_tokens and KvHandle.block_size must be > 0")
        if self.num_blocks != num_blocks_for(self.num_tokens, self.block_size):
            raise ValueError(f"KvHandle.num_blocks is {self.num_blocks}; {self.num_tokens} tokens "
                             f"in blocks of {self.block_size} need "
                             f"{num_blocks_for(self.num_tokens, self.block_size)}")
        if len(self.block_hashes) > self.num_tokens // self.block_size:
            raise ValueError("KvHandle.block_hashes has more entries than full blocks")
        if self.prompt_hash and len(self.prompt_hash) != HASH_BYTES:
            raise ValueError(f"KvHandle.prompt_hash has {len(self.prompt_hash)} bytes; it must be "
                             f"empty or {HASH_BYTES} (SHA-256)")


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Outcome of one KV load. reason: a KvTransferError reason, "spec_mismatch",
    "scales_mismatch", "hash_mismatch", "sink_error" or "cancelled" when ok is False."""

    request_id: str
    ok: bool
    reason: str | None = None
    transport: str = ""  # the way a successful load came: "cuda_ipc", "shm", "tcp", "stream"


def hash_matches(handle: KvHandle, index: int, block_hash: bytes | None) -> bool:
    """A full block the handle names by hash must arrive under that hash."""
    return index >= len(handle.block_hashes) or block_hash == handle.block_hashes[index]
