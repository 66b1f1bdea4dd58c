"""Stable block identity (docs/architecture.md, "Where each concept lives").

    hash_0 = H(root ‖ tokens of block 0 ‖ extra)
    hash_i = H(hash_{i-1} ‖ tokens of block i ‖ extra)
    root   = H("splitserve-root" ‖ model fingerprint ‖ tenant salt)

H is SHA-256, so the same key names a block on the GPU, in the CPU tier, in Redis and in the
router, across processes and machines. Only full blocks are hashed; `prompt_hash` covers a
whole prompt, its partial last block included, so a KV handle names exactly one prompt.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

HASH_BYTES = 32


def model_fingerprint(
    model: dict[str, Any],
    *,
    dtype: str,
    kv_cache_dtype: str,
    block_size: int,
    parallel_layout: str = "tp1",
) -> bytes:
    """32-byte fingerprint binding architecture, weights identity, dtypes, block size, layout.

    `model` is any JSON-serialisable description of the architecture and weights (the engine
    passes `ModelConfig.to_hf_dict()` plus `weights_id`). Two workers exchange KV only when their
    fingerprints are equal.
    """
    canonical = json.dumps(
        {
            "model": model,
            "dtype": dtype,
            "kv_cache_dtype": kv_cache_dtype,
            "block_size": block_size,
            "parallel_layout": parallel_layout,
        },
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256(canonical.encode()).digest()


def root_hash(fingerprint: bytes, tenant_salt: str = "") -> bytes:
    """Root of every hash chain; a tenant salt isolates tenants' caches from each other."""
    return hashlib.sha256(b"splitserve-root\x00" + fingerprint + tenant_salt.encode()).digest()


def salted_root(root: bytes, cache_salt: str) -> bytes:
    """A request's own root under its `cache_salt` (vLLM's per-request salt): its blocks' hashes
    match only requests with the same salt (and model, adapter), so a tenant's prompts are
    never prefix hits for another's, nor timed by them."""
    return hashlib.sha256(b"splitserve-salt\x00" + root + cache_salt.encode()).digest()


MAX_CACHE_SALT_CHARS = 256


def cache_salt_problem(cache_salt: object) -> str | None:
    """Why `cache_salt` is not one (None: it is, or there is none): a non-empty string of at
    most MAX_CACHE_SALT_CHARS characters. The one rule the engine, the workers and the gateway
    each raise in their own error type."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > MAX_CACHE_SALT_CHARS:
        return (f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                "characters")
    return None


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as hashed: little-endian uint32 each."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def block_hash(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Hash of one full block chained on its parent's hash."""
    h = hashlib.sha256(parent)
    h.update(_token_bytes(token_ids))
    h.update(extra)
    return h.digest()


def compute_block_hashes(
    root: bytes,
    token_ids: Sequence[int],
    block_size: int,
    existing: Sequence[bytes] = (),
) -> list[bytes]:
    """Hashes of all full blocks of `token_ids`, reusing the already computed `existing` prefix.

    Each hash equals `block_hash(parent, block_tokens)`; the new blocks' tokens are packed in one
    call rather than one per block (0.35 -> 0.19 ms for a 4096-token prompt in 16-token blocks on
    this project's CPU), since the gateway and every worker hash each prompt on its way in."""
    hashes = list(existing)
    start, num_full = len(hashes), len(token_ids) // block_size
    if num_full <= start:
        return hashes
    data = _token_bytes(token_ids[start * block_size:num_full * block_size])
    step = 4 * block_size
    parent = hashes[-1] if hashes else root
    sha256 = hashlib.sha256
    for offset in range(0, len(data), step):
        parent = sha256(parent + data[offset:offset + step]).digest()
        hashes.append(parent)
    return hashes


def prompt_hash(fingerprint: bytes, token_ids: Sequence[int]) -> bytes:
    """SHA-256 over the model fingerprint and ALL prompt token ids (little-endian uint32).

    Block hashes cover full blocks only; this binds a KV handle to the exact prompt, so a
    decode worker can refuse KV of a prompt that differs only in its partial last block.
    """
    # The fingerprint is fixed-size (HASH_BYTES), so fingerprint ‖ ids is unambiguous.
    h = hashlib.sha256(fingerprint)
    h.update(_token_bytes(token_ids))
    return h.digest()
