"""Compile, before serving, every variant of the Triton attention kernels a step can launch.

Triton compiles a kernel the first time it meets a new combination of compile-time arguments.
The CUDA-graph capture compiles what pure-decode steps use, but eager steps (prefill chunks
mixed with decodes) choose their decode split count and prefill query tile from the step's
shape, so without this their first occurrences compile mid-run: ~1-2 s stalls each on an H200
(bench/results/h200/probe_tput_bf16_529f918.json -> triton_compiles). Per-step pointer
alignments and widths are not specialised on at all (the kernels' `do_not_specialize`), so
the variants left are the few enumerated here.
"""

from __future__ import annotations

import torch

from engine.kernels.decode_attention import (
    MAX_SPLITS,
    choose_decode_tiles,
    combine_tiles,
    paged_decode_attention,
)
from engine.kernels.prefill_attention import choose_prefill_tiles, paged_prefill_attention


def decode_split_variants(group: int, head_dim: int) -> list[int]:
    """One split count per distinct compiled form of the decode kernel (direct, or each
    combine tiling of the last split)."""
    reps: dict[tuple[bool, tuple[int, int, int]], int] = {}
    for s in range(1, MAX_SPLITS + 1):
        reps.setdefault((s == 1, combine_tiles(group, head_dim, s)), s)
    return sorted(reps.values())


def prefill_query_variants(head_dim: int, max_query_len: int) -> list[int]:
    """One max query length per distinct prefill tiling up to `max_query_len`."""
    # The tiles depend on the query length through its next power of two only.
    lengths = sorted({min(1 << i, max_query_len) for i in range(max_query_len.bit_length() + 1)})
    reps: dict[object, int] = {}
    for m in lengths:
        reps.setdefault(choose_prefill_tiles(head_dim, m), m)
    return sorted(reps.values())


def warm_up_attention(kv_cache: torch.Tensor, num_heads: int, dtype: torch.dtype,
                      max_query_len: int, k_scale: float | None = None,
                      v_scale: float | None = None) -> int:
    """Launch each variant once on one layer's cache `[2, NB, BS, Hkv, D]` (read only; the
    outputs are scratch). Returns the number of launches."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    dev = kv_cache.device
    scale = head_dim ** -0.5
    launches = 0
    q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=dev)
    for splits in decode_split_variants(num_heads // num_kv_heads, head_dim):
        # One KV tile per split: every split holds positions, and no more is read (under the
        # interpreter, whose cost is per element, 2,048 positions a launch took ~6 s).
        seq_len = choose_decode_tiles(head_dim, kv_cache.dtype, splits).block_n * splits
        tables = torch.zeros(1, -(-seq_len // block_size), dtype=torch.int32, device=dev)
        seq_lens = torch.full((1,), seq_len, dtype=torch.int32, device=dev)
        paged_decode_attention(q, kv_cache, tables, seq_lens, scale, num_splits=splits,
                               k_scale=k_scale, v_scale=v_scale)
        launches += 1
    for m in prefill_query_variants(head_dim, max_query_len):
        qp = torch.zeros(m, num_heads, head_dim, dtype=dtype, device=dev)
        qsl = torch.tensor([0, m], dtype=torch.int32, device=dev)
        lens = torch.tensor([m], dtype=torch.int32, device=dev)
        bt = torch.zeros(1, -(-m // block_size), dtype=torch.int32, device=dev)
        paged_prefill_attention(qp, kv_cache, qsl, lens, bt, scale, m, k_scale=k_scale,
                                v_scale=v_scale)
        launches += 1
    return launches
