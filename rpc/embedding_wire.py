"""An embedding on the wire (`EmbedResponse.embedding`, `Embedding.embedding`): packed
little-endian float32 values — the layout OpenAI's `encoding_format: "base64"` encodes, so the
gateway passes the bytes through. Torch-free: the gateway and the workers share it."""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

_SWAP = sys.byteorder == "big"  # array's "f" is the host's float32


def pack_float32(values: Sequence[float]) -> bytes:
    floats = array.array("f", values)
    if _SWAP:
        floats.byteswap()
    return floats.tobytes()


def unpack_float32(data: bytes) -> list[float]:
    """The values of `pack_float32`'s bytes; ValueError when they are not whole float32s."""
    if len(data) % 4:
        raise ValueError(f"an embedding is float32 values: {len(data)} bytes is not a multiple "
                         "of 4")
    floats = array.array("f")
    floats.frombytes(data)
    if _SWAP:
        floats.byteswap()
    return floats.tolist()
