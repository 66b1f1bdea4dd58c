"""Up-front validation of safetensors files, so a bad shard fails at load time, not mid-stream."""

from __future__ import annotations

import json
import os
import struct

from safetensors import safe_open

from engine_api.errors import ModelLoadError

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def read_header(path: str) -> dict[str, dict[str, object]]:
    """Tensor entries of safetensors file `path`, after checking it is complete and consistent.

    Checks: 8-byte header length, JSON header, each tensor's dtype, shape and byte range, and
    that the data section ends exactly at the end of the file (a truncated download fails here).
    Then opens it with `safe_open` so the library's own checks run too.
    """
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > _MAX_HEADER or 8 + header_len > size:
                raise ValueError(f"header length {header_len} exceeds file size {size}")
            header = json.loads(f.read(header_len))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        header.pop("__metadata__", None)
        data_len = size - 8 - header_len
        end = max((_check_entry(name, entry, data_len) for name, entry in header.items()),
                  default=0)
        if end != data_len:
            raise ValueError(f"data section is {data_len} bytes, tensors cover {end}")
        with safe_open(path, framework="pt") as sf:
            sf.keys()
    except ModelLoadError:
        raise
    except Exception as e:  # struct.error, JSONDecodeError, SafetensorError, ValueError
        raise ModelLoadError(f"{path}: corrupt or truncated safetensors file: {e}") from e
    return header


def _check_entry(name: str, entry: object, data_len: int) -> int:
    """Validate one header entry; returns the end offset of its bytes."""
    if not isinstance(entry, dict):
        raise ValueError(f"tensor {name!r}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _DTYPE_BYTES or not isinstance(shape, list) or not isinstance(offsets, list):
        raise ValueError(f"tensor {name!r}: bad dtype/shape/data_offsets")
    begin, end = offsets
    numel = 1
    for n in shape:
        numel *= int(n)
    if not 0 <= begin <= end <= data_len or end - begin != numel * _DTYPE_BYTES[dtype]:
        raise ValueError(f"tensor {name!r}: byte range {offsets} invalid for shape {shape} "
                         f"{dtype} in a data section of {data_len} bytes")
    return int(end)
