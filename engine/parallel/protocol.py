"""Commands from rank 0 to the tensor-parallel workers.

A command is a fixed header of `HEADER_FIELDS` little-endian int64s sent down each worker's
pipe (never pickle; the LoRA commands' JSON payload follows it there); its tensors follow through the process group's collectives, which every
rank enters in the order the commands were sent. Pipes carry the headers so that an idle worker
waits on its pipe, where no collective timeout runs out, and learns of rank 0's end (EOF).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from engine.config import EngineConfig

HEADER_FIELDS = 12
_HEADER = struct.Struct(f"<{HEADER_FIELDS}q")


class Op(enum.IntEnum):
    FORWARD = 1        # a forward pass: step tensors broadcast, then the model
    KV_CAPACITY = 2    # each rank's KV block capacity, all-reduced to the minimum
    ALLOCATE_KV = 3    # allocate the KV cache: fields[0] blocks
    SET_KV_SCALES = 4  # a quantized cache's [L, 2] scales (and [L, 2, Hkv, D] channel factors)
    READ_BLOCKS = 5    # block ids broadcast; each rank's heads of those blocks gathered to rank 0
    WRITE_BLOCKS = 6   # block ids broadcast; each rank's heads of the blocks scattered from 0
    SHUTDOWN = 7
    KV_AMAX = 8        # the last SCRATCH_FLOAT pass's per-channel |K|, |V| maxima, all-gathered
    # Runtime LoRA adapters: fields[0] bytes of JSON ({"name", "path"} / {"name"}) follow the
    # header down the pipe; each rank loads (or unloads) its share, and a load's success is
    # all-reduced (every rank keeps it, or none).
    LORA_ADD = 9
    LORA_REMOVE = 10


class Cache(enum.IntEnum):
    """Which KV cache a forward pass writes."""

    ENGINE = 0           # the engine's cache
    SCRATCH_FLOAT = 1    # a fresh cache in the model's dtype; its |K|, |V| maxima all-reduced
    SCRATCH_KV = 2       # a fresh cache in the engine's KV dtype and scales
    PROFILE = 3          # a fresh cache, after the device's peak memory statistics are reset


@dataclass(frozen=True, slots=True)
class ForwardHeader:
    """A forward pass's shape: what a worker needs to receive its tensors and rebuild the
    step's attention metadata."""

    num_tokens: int
    num_seqs: int
    max_blocks: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    uniform_query_len: int
    cache: Cache
    scratch_blocks: int = 0
    lora: bool = False  # the rows' LoRA adapter slots follow the step's tensors

    def fields(self) -> list[int]:
        return [self.num_tokens, self.num_seqs, self.max_blocks, self.num_decodes,
                self.max_query_len, self.max_seq_len, self.uniform_query_len, int(self.cache),
                self.scratch_blocks, int(self.lora)]

    @classmethod
    def from_fields(cls, f: list[int]) -> ForwardHeader:
        return cls(f[0], f[1], f[2], f[3], f[4], f[5], f[6], Cache(f[7]), f[8], bool(f[9]))


def pack(op: Op, fields: list[int] | tuple[int, ...] = ()) -> bytes:
    if len(fields) > HEADER_FIELDS - 1:
        raise ValueError(f"a command carries at most {HEADER_FIELDS - 1} fields")
    return _HEADER.pack(int(op), *fields, *([0] * (HEADER_FIELDS - 1 - len(fields))))


def unpack(data: bytes) -> tuple[Op, list[int]]:
    """ValueError for a header of the wrong size or an unknown op."""
    if len(data) != _HEADER.size:
        raise ValueError(f"a command header is {_HEADER.size} bytes, got {len(data)}")
    op, *fields = _HEADER.unpack(data)
    return Op(op), list(fields)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process is started with (through multiprocessing's spawn: our own child,
    on this host; nothing here crosses a network)."""

    config: EngineConfig
    rank: int
    size: int
    port: int
    device: str
    dtype: str
    max_model_len: int
