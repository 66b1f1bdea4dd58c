"""KV block wire format: round trips, every corruption maps to its KvWireError, fuzzing."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer.wire import (
    HEADER_BYTES,
    MAGIC,
    MAX_BLOCK_BYTES,
    BadMagic,
    BlockSpec,
    ChecksumMismatch,
    FingerprintMismatch,
    KvWireError,
    ShapeMismatch,
    TooLarge,
    Truncated,
    VersionMismatch,
    block_view,
    decode_block,
    encode_block,
    verify_block,
)

FP = hashlib.sha256(b"model-a").digest()
HASH = hashlib.sha256(b"block-0").digest()
# Header byte ranges (see the layout diagram in kv_transfer/wire.py).
MAGIC_RANGE = range(0, 4)
VERSION_RANGE = range(4, 6)
DECLARED_SIZE_RANGE = range(92, 104)  # num_scales (I) at 92, payload_len (Q) at 96
PAYLOAD_LEN_OFFSET = 96
NUM_SCALES_OFFSET = 92


def make_spec(dtype: torch.dtype = torch.float16, fp: bytes = FP) -> BlockSpec:
    return BlockSpec(fingerprint=fp, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                     dtype=dtype)


def random_block(spec: BlockSpec, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if spec.dtype in (torch.uint8, torch.int8):
        info = torch.iinfo(spec.dtype)
        return torch.randint(info.min, info.max + 1, spec.shape, generator=g, dtype=spec.dtype)
    return torch.randn(spec.shape, generator=g).to(spec.dtype)


def scales_for(spec: BlockSpec) -> torch.Tensor | None:
    if spec.num_scales == 0:
        return None
    return torch.arange(spec.num_scales, dtype=torch.float32).reshape(spec.num_layers, 2) + 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8,
                                   torch.int8, torch.float8_e4m3fn])
def test_round_trip_is_bitwise(dtype: torch.dtype) -> None:
    spec = make_spec(dtype)
    if dtype == torch.float8_e4m3fn:
        tensor = torch.randn(spec.shape).to(dtype)
    else:
        tensor = random_block(spec)
    data = encode_block(spec, HASH, spec.block_size, tensor, scales_for(spec))
    assert len(data) == spec.encoded_nbytes
    out = decode_block(data, spec)
    assert out.block_hash == HASH and out.num_tokens == spec.block_size
    assert out.tensor.dtype == dtype and tuple(out.tensor.shape) == spec.shape
    assert torch.equal(out.tensor.view(torch.uint8), tensor.view(torch.uint8))
    if spec.num_scales:
        expected_scales = scales_for(spec)
        assert out.scales is not None and expected_scales is not None
        assert torch.equal(out.scales, expected_scales)
    else:
        assert out.scales is None


def test_partial_last_block_has_no_hash_and_decodes_from_memoryview() -> None:
    spec = make_spec(torch.bfloat16)
    tensor = random_block(spec, seed=3)
    data = encode_block(spec, None, 3, tensor)
    out = decode_block(memoryview(data), spec)
    assert out.block_hash is None and out.num_tokens == 3
    assert torch.equal(out.tensor.view(torch.uint8), tensor.view(torch.uint8))


def test_non_contiguous_cache_slice_encodes_its_block() -> None:
    spec = make_spec(torch.float32)
    cache = torch.randn(spec.num_layers, 2, 5, spec.block_size, spec.num_kv_heads, spec.head_dim)
    data = encode_block(spec, HASH, spec.block_size, cache[:, :, 3])
    assert torch.equal(decode_block(data, spec).tensor, cache[:, :, 3])


def test_encode_refuses_caller_bugs() -> None:
    spec = make_spec(torch.float16)
    tensor = random_block(spec)
    with pytest.raises(ValueError, match="partial block"):
        encode_block(spec, HASH, 2, tensor)
    with pytest.raises(ValueError, match="num_tokens"):
        encode_block(spec, HASH, spec.block_size + 1, tensor)
    with pytest.raises(ShapeMismatch):
        encode_block(spec, HASH, spec.block_size, tensor.float())
    with pytest.raises(ShapeMismatch, match="scales"):
        encode_block(spec, HASH, spec.block_size, tensor, torch.ones(2, 2))
    int8_spec = make_spec(torch.int8)
    with pytest.raises(ShapeMismatch, match="scales"):
        encode_block(int8_spec, HASH, 4, random_block(int8_spec))
    with pytest.raises(ValueError, match="fingerprint"):
        make_spec(fp=b"short")


def expected_error_for_flip(bad: bytes | bytearray, offset: int) -> type[KvWireError]:
    """Order of checks: magic, version, declared sizes, checksum (covers everything else)."""
    if offset in MAGIC_RANGE:
        return BadMagic
    if offset in VERSION_RANGE:
        return VersionMismatch
    if offset in DECLARED_SIZE_RANGE:  # num_scales / payload_len: the declared length changes
        (num_scales,) = struct.unpack_from("<I", bad, NUM_SCALES_OFFSET)
        (payload_len,) = struct.unpack_from("<Q", bad, PAYLOAD_LEN_OFFSET)
        too_large = payload_len > MAX_BLOCK_BYTES or 4 * num_scales > MAX_BLOCK_BYTES
        return TooLarge if too_large else Truncated
    return ChecksumMismatch


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_every_single_byte_flip_is_detected(dtype: torch.dtype) -> None:
    spec = make_spec(dtype)
    data = encode_block(spec, HASH, spec.block_size, random_block(spec), scales_for(spec))
    for offset in range(len(data)):
        bad = bytearray(data)
        bad[offset] ^= 0x01
        with pytest.raises(KvWireError) as info:
            decode_block(bytes(bad), spec)
        assert type(info.value) is expected_error_for_flip(bad, offset), offset


def test_truncation_at_many_offsets() -> None:
    spec = make_spec(torch.float32)
    data = encode_block(spec, HASH, spec.block_size, random_block(spec))
    for cut in [0, 1, 3, 4, 5, 50, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 1,
                len(data) // 2, len(data) - 1]:
        with pytest.raises(Truncated):
            decode_block(data[:cut], spec)
    with pytest.raises(Truncated, match="trailing"):
        decode_block(data + b"\x00", spec)


def test_wrong_fingerprint_and_wrong_shape_spec() -> None:
    spec = make_spec(torch.float16)
    data = encode_block(spec, HASH, spec.block_size, random_block(spec))
    with pytest.raises(FingerprintMismatch):
        decode_block(data, make_spec(torch.float16, fp=hashlib.sha256(b"model-b").digest()))
    others = [dataclasses.replace(spec, num_layers=4, head_dim=4),
              dataclasses.replace(spec, num_kv_heads=1, head_dim=16),
              dataclasses.replace(spec, block_size=8, head_dim=4)]
    for other in others:
        assert other.block_nbytes == spec.block_nbytes  # only the shape differs
        with pytest.raises(ShapeMismatch):
            decode_block(data, other)
    with pytest.raises(ShapeMismatch, match="dtype"):
        decode_block(data, dataclasses.replace(spec, dtype=torch.bfloat16))


def test_verify_block_checks_the_expected_hash() -> None:
    spec = make_spec(torch.float16)
    data = encode_block(spec, HASH, spec.block_size, random_block(spec))
    assert verify_block(data, spec, HASH).block_hash == HASH
    with pytest.raises(ShapeMismatch, match="hash"):
        verify_block(data, spec, hashlib.sha256(b"other").digest())


def test_huge_declared_length_is_refused_before_allocating() -> None:
    spec = make_spec(torch.float16)
    data = bytearray(encode_block(spec, HASH, spec.block_size, random_block(spec)))
    struct.pack_into("<Q", data, PAYLOAD_LEN_OFFSET, 1 << 62)
    with pytest.raises(TooLarge):
        decode_block(bytes(data), spec)
    struct.pack_into("<Q", data, PAYLOAD_LEN_OFFSET, spec.block_nbytes)
    struct.pack_into("<I", data, NUM_SCALES_OFFSET, MAX_BLOCK_BYTES)  # num_scales * 4 > limit
    with pytest.raises(TooLarge):
        decode_block(bytes(data), spec)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_random_bytes_only_raise_wire_errors(blob: bytes) -> None:
    spec = make_spec(torch.float16)
    for data in (blob, MAGIC + struct.pack("<H", 1) + blob):
        with pytest.raises(KvWireError):
            decode_block(data, spec)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1,
                max_size=8), st.integers(0, 2_000))
def test_fuzz_mutated_valid_blocks_never_escape(edits: list[tuple[int, int]], cut: int) -> None:
    spec = make_spec(torch.int8)
    good = encode_block(spec, HASH, spec.block_size, random_block(spec), scales_for(spec))
    data = bytearray(good)
    for pos, value in edits:
        data[pos % len(data)] = value
    if cut % 2:  # odd: also truncate
        data = data[:cut % len(data)]
    try:
        out = decode_block(bytes(data), spec)
    except KvWireError:
        return
    assert bytes(data) == good and out.num_tokens == spec.block_size  # only a no-op edit passes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_block_view_reads_a_kept_entry_in_place_with_every_check_but_the_checksum(
        dtype: torch.dtype) -> None:
    """A CPU-tier entry (verified when stored) is read as a view of its own memory: the same
    block as `decode_block`, no copy; the header is still checked (another model's or another
    block's bytes are refused), the checksum is not: a flipped payload byte goes unnoticed
    here, which is why only entries verified on the way in may be read this way."""
    spec = make_spec(dtype)
    tensor = torch.randn(spec.shape).to(dtype)
    data = encode_block(spec, HASH, spec.block_size, tensor, scales_for(spec))
    entry = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    block, want = block_view(entry, spec), decode_block(data, spec)
    assert torch.equal(block.tensor.view(torch.uint8), want.tensor.view(torch.uint8))
    assert block.block_hash == HASH and block.num_tokens == spec.block_size
    assert (block.scales is None) == (want.scales is None)
    if want.scales is not None:
        assert block.scales is not None and torch.equal(block.scales, want.scales)
    start = entry.data_ptr()
    assert start <= block.tensor.data_ptr() < start + entry.numel()  # a view, not a copy
    from_bytes = block_view(data, spec)  # bytes are read-only: copied
    assert torch.equal(from_bytes.tensor.view(torch.uint8), want.tensor.view(torch.uint8))

    entry[-1] ^= 0xFF
    assert block_view(entry, spec).tensor.view(torch.uint8).reshape(-1)[-1] == entry[-1]
    with pytest.raises(ChecksumMismatch):
        decode_block(entry.numpy().tobytes(), spec)
    with pytest.raises(FingerprintMismatch):
        block_view(entry, make_spec(dtype, fp=hashlib.sha256(b"model-b").digest()))
    with pytest.raises(ShapeMismatch):
        block_view(entry, make_spec(torch.float32 if dtype != torch.float32 else torch.float16))
    with pytest.raises(ValueError, match="1-D uint8"):
        block_view(entry.view(torch.int8), spec)
