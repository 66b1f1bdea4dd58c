"""Binary wire format of one KV block (docs/architecture.md, "Shared contracts"): the same bytes travel over gRPC and live
in the CPU and Redis tiers.

A block is `kv_cache[:, :, block_id]` of the engine's cache, i.e. a tensor
`[num_layers, 2, block_size, num_kv_heads, head_dim]` (0 = K, 1 = V). Layout of the bytes::

    +---------------------------- header (HEADER_BYTES = 108, little-endian) ---------------+
    | magic  b"SSKV"            4s | version            H | dtype code  B | flags   B        |
    | fingerprint              32s | block hash       32s  (zeros: no hash, e.g. partial)    |
    | num_layers  I | block_size I | num_kv_heads I | head_dim I | num_tokens I            |
    | num_scales  I | payload_len Q | checksum I                                             |
    +---------------------------------------------------------------------------------------+
    | scales: num_scales float32 (little-endian); [num_layers, 2] for uint8/int8/fp8 KV     |
    +---------------------------------------------------------------------------------------+
    | payload: payload_len raw tensor bytes, row-major, host (little-endian) byte order      |
    +---------------------------------------------------------------------------------------+

The checksum is CRC-32 (`zlib.crc32`; always available, no extra package, ~GB/s) over the header
without its checksum field, then the scales, then the payload. CRC-32 detects corruption; it is
not a defence against a malicious writer (Redis and the KV port are trusted-network services).

Decoding never unpickles anything and never trusts a length before checking it against a limit:
every problem raises a `KvWireError` subclass, which callers treat as a cache miss.
"""

from __future__ import annotations

import struct
import sys
import zlib
from dataclasses import dataclass

import torch

MAGIC = b"SSKV"
WIRE_VERSION = 1
FINGERPRINT_BYTES = 32
HASH_BYTES = 32
MAX_BLOCK_BYTES = 64 << 20  # largest payload accepted (and produced): checked before allocating
_ZERO_HASH = bytes(HASH_BYTES)

# magic, version, dtype, flags, fingerprint, hash, L, bs, Hkv, D, num_tokens, num_scales,
# payload_len, checksum
_HEADER = struct.Struct("<4sHBB32s32sIIIIIIQI")
HEADER_BYTES = _HEADER.size
_CHECKSUM_BYTES = 4
_PREFIX = struct.Struct("<4sH")  # magic + version: readable before anything else

# Stable codes: never renumber (they are part of wire version 1).
_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.uint8: 4,
    torch.int8: 5,
    torch.float8_e4m3fn: 6,
    torch.float8_e5m2: 7,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_KNOWN_FLAGS = 0  # no flags defined in version 1; a set bit is refused

if sys.byteorder != "little":  # payload bytes are the host's; every supported host is LE
    raise ImportError("kv_transfer.wire supports little-endian hosts only")


class KvWireError(Exception):
    """Encoded block is unusable; the caller treats it as a cache miss (or a failed transfer)."""


class BadMagic(KvWireError):
    """The bytes do not start with b"SSKV"."""


class VersionMismatch(KvWireError):
    """The block was written by another wire version."""


class FingerprintMismatch(KvWireError):
    """The block was computed under another model fingerprint."""


class ShapeMismatch(KvWireError):
    """dtype, shape, scales or token count disagree with the local BlockSpec (or are invalid)."""


class ChecksumMismatch(KvWireError):
    """CRC-32 over header, scales and payload does not match."""


class Truncated(KvWireError):
    """Fewer (or more) bytes than the header declares."""


class TooLarge(KvWireError):
    """The header declares more bytes than the limit allows; refused before allocating."""


def is_quantized(dtype: torch.dtype) -> bool:
    """One-byte KV dtypes (fp8 stored as uint8/float8, int8) carry per-layer scales."""
    return dtype.itemsize == 1


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """Local layout of one KV block: what an incoming block must match exactly.

    fingerprint: 32-byte model fingerprint (`engine_api.hashing.model_fingerprint`).
    """

    fingerprint: bytes
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.fingerprint, bytes) or len(self.fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"BlockSpec.fingerprint must be {FINGERPRINT_BYTES} bytes")
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BlockSpec.{name} must be a positive int, got {value!r}")
        if self.dtype not in _DTYPE_CODES:
            allowed = ", ".join(str(d) for d in _DTYPE_CODES)
            raise ValueError(f"BlockSpec.dtype {self.dtype} is not supported; allowed: {allowed}")
        if self.block_nbytes > MAX_BLOCK_BYTES:
            raise ValueError(
                f"BlockSpec: one block is {self.block_nbytes} bytes, above the "
                f"{MAX_BLOCK_BYTES}-byte limit of the wire format")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """[num_layers, 2, block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's tensor (the payload)."""
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * self.dtype.itemsize)

    @property
    def num_scales(self) -> int:
        """float32 scales per block: [num_layers, 2] for 1-byte KV dtypes, else none."""
        return self.num_layers * 2 if is_quantized(self.dtype) else 0

    @property
    def encoded_nbytes(self) -> int:
        """Exact size of `encode_block(self, ...)` output."""
        return HEADER_BYTES + 4 * self.num_scales + self.block_nbytes


@dataclass(frozen=True, slots=True)
class DecodedBlock:
    """A verified block. block_hash is None when the block has no hash (a partial block).

    tensor: [num_layers, 2, block_size, num_kv_heads, head_dim] on the CPU, owning its memory;
    rows at or beyond num_tokens are whatever the sender's cache held (meaningless).
    scales: [num_layers, 2] float32 for quantized KV, else None.
    """

    block_hash: bytes | None
    num_tokens: int
    tensor: torch.Tensor
    scales: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class WireHeader:
    """Parsed header fields (after `verify_block`, consistent with the spec)."""

    block_hash: bytes | None
    num_tokens: int
    num_scales: int
    payload_len: int


def encode_block(
    spec: BlockSpec,
    block_hash: bytes | None,
    num_tokens: int,
    tensor: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> bytes:
    """Serialize one block. Raises ShapeMismatch/ValueError on a caller bug (never on the wire).

    block_hash: 32 bytes for a full block, None (or b"") for a block without a hash; a partial
    block (num_tokens < block_size) cannot have one, since only full blocks are hashed.
    tensor: [num_layers, 2, block_size, num_kv_heads, head_dim] of spec.dtype, any device.
    scales: [num_layers, 2] float32, required for 1-byte dtypes and refused otherwise.
    """
    hash_field = _hash_field(spec, block_hash, num_tokens)
    _check_tensor(spec, tensor)
    scale_bytes = _scale_bytes(spec, scales)
    # .view(uint8) reinterprets the bytes (bf16 included) without numpy dtype support. The
    # checksum and the join read the tensor's memory in place: the join is the only copy.
    flat = tensor.detach().contiguous().view(torch.uint8).reshape(-1).cpu()
    payload = flat.numpy().data  # a memoryview of the tensor's bytes
    head = _HEADER.pack(MAGIC, WIRE_VERSION, _DTYPE_CODES[spec.dtype], 0, spec.fingerprint,
                        hash_field, spec.num_layers, spec.block_size, spec.num_kv_heads,
                        spec.head_dim, num_tokens, spec.num_scales, payload.nbytes, 0)
    head_wo_crc = head[:-_CHECKSUM_BYTES]
    crc = zlib.crc32(payload, zlib.crc32(scale_bytes, zlib.crc32(head_wo_crc)))
    return b"".join((head_wo_crc, struct.pack("<I", crc), scale_bytes, payload))


def _hash_field(spec: BlockSpec, block_hash: bytes | None, num_tokens: int) -> bytes:
    if not isinstance(num_tokens, int) or not 1 <= num_tokens <= spec.block_size:
        raise ValueError(f"num_tokens must be in [1, {spec.block_size}], got {num_tokens!r}")
    if not block_hash:
        return _ZERO_HASH
    if len(block_hash) != HASH_BYTES or block_hash == _ZERO_HASH:
        raise ValueError(f"block_hash must be {HASH_BYTES} non-zero bytes or None")
    if num_tokens != spec.block_size:
        raise ValueError("a partial block (num_tokens < block_size) cannot carry a block hash")
    return block_hash


def _check_tensor(spec: BlockSpec, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
        raise ShapeMismatch(
            f"block tensor is {tuple(tensor.shape)} {tensor.dtype}; the spec wants "
            f"{spec.shape} {spec.dtype}")


def _scale_bytes(spec: BlockSpec, scales: torch.Tensor | None) -> bytes:
    if spec.num_scales == 0:
        if scales is not None:
            raise ShapeMismatch(f"scales are only allowed for 1-byte KV dtypes, not {spec.dtype}")
        return b""
    if scales is None or tuple(scales.shape) != (spec.num_layers, 2):
        got = None if scales is None else tuple(scales.shape)
        raise ShapeMismatch(f"{spec.dtype} KV needs scales [{spec.num_layers}, 2], got {got}")
    return struct.pack(f"<{spec.num_scales}f", *scales.detach().float().cpu().reshape(-1).tolist())


def verify_block(
    data: bytes | bytearray | memoryview,
    spec: BlockSpec,
    expected_hash: bytes | None = None,
    checksum: bool = True,
) -> WireHeader:
    """Check everything about `data` (lengths, checksum, fingerprint, shape) without building
    a tensor. expected_hash: when given, the block's hash must equal it (ShapeMismatch if not —
    the bytes name another block). checksum=False skips the CRC: only for bytes this process
    has just encoded."""
    view = memoryview(data).cast("B")
    header = _parse_header(view, spec, checksum=checksum)
    if expected_hash is not None and header.block_hash != expected_hash:
        raise ShapeMismatch("block hash in the header differs from the hash it was looked up by")
    return header


def decode_block(data: bytes | bytearray | memoryview, spec: BlockSpec) -> DecodedBlock:
    """Verify and deserialize one block into CPU tensors owning their memory."""
    view = memoryview(data).cast("B")
    header = _parse_header(view, spec)
    scales, start = _scales(view, header, spec)
    # bytearray: a writable copy, so torch.frombuffer owns valid memory with no warning.
    payload = bytearray(view[start:start + header.payload_len])
    tensor = torch.frombuffer(payload, dtype=torch.uint8).view(spec.dtype).reshape(spec.shape)
    return DecodedBlock(header.block_hash, header.num_tokens, tensor, scales)


def block_view(data: bytes | torch.Tensor, spec: BlockSpec) -> DecodedBlock:
    """A block this process verified (`verify_block`) when it took the bytes in, and has kept
    in its own memory since (a CPU-tier entry): every check of `decode_block` but the checksum
    (memory is not a lossy channel, and re-reading each block for it slowed tier loads), and
    for a 1-D uint8 CPU tensor (a pinned entry) the payload as a view of it, without a copy:
    keep `data` unchanged while the block is in use."""
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1 or data.device.type != "cpu":
            raise ValueError("block_view takes bytes or a 1-D uint8 CPU tensor")
        view = memoryview(data.numpy().data).cast("B")
    else:
        view = memoryview(data).cast("B")
    header = _parse_header(view, spec, checksum=False)
    scales, start = _scales(view, header, spec)
    if isinstance(data, torch.Tensor):
        raw = data[start:start + header.payload_len]
    else:  # bytes are read-only: torch.frombuffer needs a writable copy
        raw = torch.frombuffer(bytearray(view[start:start + header.payload_len]),
                               dtype=torch.uint8)
    return DecodedBlock(header.block_hash, header.num_tokens,
                        raw.view(spec.dtype).reshape(spec.shape), scales)


def _scales(view: memoryview, header: WireHeader, spec: BlockSpec
            ) -> tuple[torch.Tensor | None, int]:
    """The block's [num_layers, 2] scales (None without), and where its payload starts."""
    start = HEADER_BYTES + 4 * header.num_scales
    if not header.num_scales:
        return None, start
    values = struct.unpack(f"<{header.num_scales}f", view[HEADER_BYTES:start])
    return torch.tensor(values, dtype=torch.float32).reshape(spec.num_layers, 2), start


def _parse_header(view: memoryview, spec: BlockSpec, checksum: bool = True) -> WireHeader:
    """Checks in a fixed order (tests rely on it): magic, version, declared sizes, length,
    checksum (unless `checksum` is False: `block_view`), then agreement with the local spec."""
    if len(view) >= _PREFIX.size:
        magic, version = _PREFIX.unpack_from(view)
        if magic != MAGIC:
            raise BadMagic(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
        if version != WIRE_VERSION:
            raise VersionMismatch(f"wire version {version}, this process reads {WIRE_VERSION}")
    if len(view) < HEADER_BYTES:
        raise Truncated(f"{len(view)} bytes is shorter than the {HEADER_BYTES}-byte header")
    fields = _HEADER.unpack_from(view)
    (_, _, dtype_code, flags, fingerprint, hash_field, num_layers, block_size, num_kv_heads,
     head_dim, num_tokens, num_scales, payload_len, stored_crc) = fields
    _check_sizes(len(view), num_scales, payload_len)
    if checksum:
        head_wo_crc = view[:HEADER_BYTES - _CHECKSUM_BYTES]
        crc = zlib.crc32(view[HEADER_BYTES:], zlib.crc32(head_wo_crc))
        if crc != stored_crc:
            raise ChecksumMismatch(f"crc32 {crc:#010x} != header checksum {stored_crc:#010x}")
    if fingerprint != spec.fingerprint:
        raise FingerprintMismatch(
            f"block fingerprint {bytes(fingerprint).hex()[:16]}… differs from the local "
            f"{spec.fingerprint.hex()[:16]}…")
    _check_layout(spec, dtype_code, flags, (num_layers, block_size, num_kv_heads, head_dim),
                  num_scales, payload_len)
    block_hash = None if hash_field == _ZERO_HASH else bytes(hash_field)
    _check_tokens(spec, num_tokens, block_hash)
    return WireHeader(block_hash, num_tokens, num_scales, payload_len)


def _check_sizes(nbytes: int, num_scales: int, payload_len: int) -> None:
    if payload_len > MAX_BLOCK_BYTES or num_scales * 4 > MAX_BLOCK_BYTES:
        raise TooLarge(f"declared payload {payload_len} B / {num_scales} scales exceed the "
                       f"{MAX_BLOCK_BYTES}-byte limit")
    declared = HEADER_BYTES + 4 * num_scales + payload_len
    if nbytes < declared:
        raise Truncated(f"{nbytes} bytes, header declares {declared}")
    if nbytes > declared:
        raise Truncated(f"{nbytes} bytes, header declares only {declared} (trailing data)")


def _check_layout(spec: BlockSpec, dtype_code: int, flags: int, dims: tuple[int, ...],
                  num_scales: int, payload_len: int) -> None:
    if flags & ~_KNOWN_FLAGS:
        raise ShapeMismatch(f"unknown header flags {flags:#04x}")
    dtype = _CODE_DTYPES.get(dtype_code)
    if dtype != spec.dtype:
        raise ShapeMismatch(f"block dtype code {dtype_code} ({dtype}), local KV is {spec.dtype}")
    local = (spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if dims != local:
        raise ShapeMismatch(f"block (layers, block_size, kv_heads, head_dim) = {dims}, "
                            f"local {local}")
    if num_scales != spec.num_scales or payload_len != spec.block_nbytes:
        raise ShapeMismatch(f"block has {num_scales} scales / {payload_len} B, local spec "
                            f"wants {spec.num_scales} / {spec.block_nbytes}")


def _check_tokens(spec: BlockSpec, num_tokens: int, block_hash: bytes | None) -> None:
    if not 1 <= num_tokens <= spec.block_size:
        raise ShapeMismatch(f"num_tokens {num_tokens} outside [1, {spec.block_size}]")
    if block_hash is not None and num_tokens != spec.block_size:
        raise ShapeMismatch("a partial block carries a block hash")
