"""Triton kernels vs their torch references vs independent naive loops (TRITON_INTERPRET=1, CPU).

Shapes are tiny because the interpreter is slow. Every attention check uses fresh random inputs,
shuffled block tables whose unused entries point at real (wrong) blocks, NaN-poisoned outputs,
variable lengths and prefix hits; decode forces split-K with several split counts.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.interpret import interpret_or_skip, interpreted_kernel_imports

# The autouse fixture below turns the interpreter on again for the tests of this module only.
with interpreted_kernel_imports():
    from engine import kernels as K
    from engine.kernels import decode_attention as decode_mod
    from engine.kernels import reference as R
    from engine.kernels._attention_tile import KvCvt, TileDots, kv_cvt_supported, tile_dots
    from engine.kernels._checks import KernelInputError

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    interpret_or_skip(monkeypatch, decode_mod._decode_split_kernel)
    yield


_TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def assert_close_for(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Compare in float64 with an absolute/relative tolerance suited to the kernel dtype."""
    tol = _TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- paged batches


@dataclass
class PagedBatch:
    """A random varlen batch whose KV lives in shuffled cache blocks."""

    q: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, NB, BS, Hkv, D]
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    q_lens: list[int]
    seq_lens_list: list[int]


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(per_seq) + 2  # spare columns: the kernels must never read them
    num_blocks = sum(per_seq) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    # Unused table entries hold real block ids (wrong ones), so reading them corrupts results.
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen,
                                 dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        block_tables[b, :n] = perm[used:used + n]
        used += n
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                           generator=gen).to(dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        q=q,
        kv_cache=kv_cache,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        q_lens=list(q_lens),
        seq_lens_list=list(seq_lens),
    )


def naive_attention(batch: PagedBatch, scale: float, window: int = 0, softcap: float = 0.0
                    ) -> torch.Tensor:
    """Independent oracle: walk every position through the block table by hand, one query row
    and head at a time, with an explicit causal (and, given `window`, sliding-window) mask,
    scores soft-capped by `softcap` (when > 0), and torch.softmax (float64)."""
    q, kv_cache = batch.q, batch.kv_cache
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.seq_lens_list, strict=True)):
        keys = torch.stack([kv_cache[0, int(batch.block_tables[b, p // block_size]),
                                     p % block_size] for p in range(seq_len)]).double()
        values = torch.stack([kv_cache[1, int(batch.block_tables[b, p // block_size]),
                                       p % block_size] for p in range(seq_len)]).double()
        for i in range(q_len):
            position = seq_len - q_len + i
            mask = torch.tensor([position - window < p <= position if window else p <= position
                                 for p in range(seq_len)])
            for h in range(q.shape[1]):
                scores = keys[:, h // group] @ q[start + i, h].double() * scale  # [seq_len]
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                scores = scores.masked_fill(~mask, float("-inf"))
                out[start + i, h] = torch.softmax(scores, dim=0) @ values[:, h // group]
        start += q_len
    return out


def decode_batch(seq_lens: list[int], **kwargs: object) -> PagedBatch:
    return make_batch([1] * len(seq_lens), seq_lens, **kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- references


@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "block_size"),
    [
        ([7, 1, 12], [7, 20, 30], 4),  # fresh prefill, a decode row, a prefix hit
        ([1, 1, 1], [1, 9, 33], 16),  # pure decode
        ([5], [5], 16),
    ],
)
def test_reference_attention_matches_naive(
    q_lens: list[int], seq_lens: list[int], block_size: int
) -> None:
    batch = make_batch(q_lens, seq_lens, block_size=block_size, seed=len(q_lens) + block_size)
    want = naive_attention(batch, 0.17)
    got = R.paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                                batch.block_tables, 0.17)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_reference_decode_matches_naive() -> None:
    batch = decode_batch([3, 17, 26], block_size=4, seed=5)
    got = R.paged_decode_attention_ref(batch.q, batch.kv_cache, batch.block_tables,
                                       batch.seq_lens, 0.3)
    torch.testing.assert_close(got.double(), naive_attention(batch, 0.3), atol=1e-5, rtol=1e-5)


def test_reference_elementwise_match_naive() -> None:
    gen = torch.Generator().manual_seed(1)
    x, res, w = (torch.randn(3, 16, generator=gen) for _ in range(3))
    normed, new_res = R.rms_norm_ref(x, w[0], 1e-6, res)  # type: ignore[misc]
    s = x + res
    for r in range(3):
        rms = (sum(float(v) ** 2 for v in s[r]) / 16 + 1e-6) ** 0.5
        torch.testing.assert_close(normed[r], s[r] / rms * w[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_res, s)
    y = torch.randn(2, 8, generator=gen)
    want = torch.stack([torch.tensor([float(a) / (1 + torch.exp(-a).item()) * float(b)
                                      for a, b in zip(row[:4], row[4:], strict=True)])
                        for row in y])
    torch.testing.assert_close(R.silu_and_mul_ref(y), want, atol=1e-6, rtol=1e-6)
    # RoPE: neox rotation of one head by angle theta equals a 2-D rotation of each pair.
    q = torch.randn(1, 1, 4, generator=gen)
    k = q.clone()
    theta = torch.tensor([[0.3, 1.1]])
    cache = torch.cat([theta.cos(), theta.sin()], dim=1)  # [1, 4]
    q_rot = q.clone()
    R.rotary_embedding_ref(torch.tensor([0]), q_rot, k, cache, is_neox=True)
    for i in range(2):
        c, s_ = theta[0, i].cos(), theta[0, i].sin()
        x1, x2 = q[0, 0, i], q[0, 0, i + 2]
        torch.testing.assert_close(q_rot[0, 0, i], x1 * c - x2 * s_)
        torch.testing.assert_close(q_rot[0, 0, i + 2], x2 * c + x1 * s_)


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize(
    ("dtype", "num_splits", "block_size", "head_dim", "heads"),
    [
        (torch.float32, None, 4, 32, (4, 2)),
        (torch.float32, 1, 16, 16, (4, 4)),
        (torch.float32, 3, 4, 32, (4, 2)),
        (torch.float32, 8, 4, 32, (6, 2)),  # group of 3: padded rows in the dot
        (torch.float16, 2, 16, 32, (4, 2)),
        (torch.bfloat16, 5, 4, 32, (4, 1)),
    ],
)
def test_decode_matches_reference_and_naive(
    dtype: torch.dtype, num_splits: int | None, block_size: int, head_dim: int,
    heads: tuple[int, int],
) -> None:
    num_heads, num_kv_heads = heads
    batch = decode_batch([1, 19, 40], num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, block_size=block_size, dtype=dtype,
                         seed=block_size * 7 + (num_splits or 0))
    out = torch.full_like(batch.q, float("nan"))
    got = K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                   0.25, out=out, num_splits=num_splits)
    assert got is out
    assert torch.isfinite(out).all(), "some output elements were never written"
    ref = R.paged_decode_attention_ref(batch.q, batch.kv_cache, batch.block_tables,
                                       batch.seq_lens, 0.25)
    assert_close_for(out.float(), ref.float(), dtype)
    assert_close_for(out.double(), naive_attention(batch, 0.25), dtype)


def test_decode_split_k_is_independent_of_split_count() -> None:
    batch = decode_batch([2, 17, 33], block_size=4, seed=11)
    outs = [K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables,
                                     batch.seq_lens, 0.2, num_splits=n) for n in (1, 2, 4, 16)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)


def test_decode_zero_length_sequence_gives_zeros() -> None:
    # CUDA-graph padding rows have seq_len 0: the output must be finite (zeros), not NaN.
    batch = decode_batch([5, 9], block_size=4, seed=3)
    seq_lens = torch.tensor([0, 9], dtype=torch.int32)
    for n in (1, 3):
        out = K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, seq_lens,
                                       0.2, num_splits=n)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isfinite(out).all()


def test_decode_accepts_strided_query_view() -> None:
    batch = decode_batch([6, 13], block_size=4, seed=4)
    padded = torch.randn(2, batch.q.shape[1] * batch.q.shape[2] + 8)
    q_view = padded[:, :batch.q[0].numel()].view_as(batch.q)
    q_view.copy_(batch.q)
    out = K.paged_decode_attention(q_view, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                   0.2, num_splits=2)
    ref = R.paged_decode_attention_ref(batch.q, batch.kv_cache, batch.block_tables,
                                       batch.seq_lens, 0.2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_choose_num_splits_depends_only_on_host_ints() -> None:
    choose = K.choose_num_splits
    assert choose(256, 8, 8192, 132) == 1  # batch alone fills the GPU
    assert choose(1, 8, 8192, 132) > 8  # long single sequence: split it
    assert choose(1, 8, 100, 132) == 1  # too short to split
    assert 1 <= choose(1, 1, 10**6, 132) <= decode_mod.MAX_SPLITS


# Last-arriver reduction: with num_splits > 1 the last split program of each (sequence, kv_head)
# combines the partials in the same launch and resets its counter for the next launch.


def _gqa4_batch(seq_lens: list[int], dtype: torch.dtype, seed: int) -> PagedBatch:
    return decode_batch(seq_lens, num_heads=8, num_kv_heads=2, head_dim=16, block_size=4,
                        dtype=dtype, seed=seed)


def _decode_twice(batch: PagedBatch, num_splits: int, **scales: object) -> list[torch.Tensor]:
    """Two launches in a row on the same `out` (NaN-poisoned before each) and counters."""
    out = torch.empty_like(batch.q)
    results = []
    for _ in range(2):
        out.fill_(float("nan"))
        K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                 0.3, out=out, num_splits=num_splits, **scales)  # type: ignore[arg-type]
        results.append(out.clone())
    return results


def _assert_counters_reset(device: torch.device) -> None:
    assert not decode_mod._split_counters[device].any(), "a split counter was left non-zero"


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_last_split_reduces_in_one_launch(
    num_splits: int, dtype: torch.dtype
) -> None:
    # Padding rows (0), lengths shorter than the split count (empty splits), several KV tiles
    # per split, and empty trailing splits (37 positions in 8 splits of 16).
    batch = _gqa4_batch([0, 2, 37], dtype, seed=num_splits)
    want = R.paged_decode_attention_ref(batch.q, batch.kv_cache, batch.block_tables,
                                        batch.seq_lens, 0.3)
    for got in _decode_twice(batch, num_splits):
        assert torch.isfinite(got).all(), "some output elements were never written"
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        assert_close_for(got.float(), want.float(), dtype)
    _assert_counters_reset(batch.q.device)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_decode_fp8_last_split_reduces_in_one_launch(num_splits: int) -> None:
    batch = _gqa4_batch([0, 2, 37], torch.float32, seed=20 + num_splits)
    batch.kv_cache = (batch.kv_cache * 4).to(torch.float8_e4m3fn)
    k_scale, v_scale = torch.tensor(0.05), torch.tensor([2.0])  # per split: acc * v_scale
    want = R.paged_decode_attention_ref(batch.q, batch.kv_cache, batch.block_tables,
                                        batch.seq_lens, 0.3, k_scale, v_scale)
    for got in _decode_twice(batch, num_splits, k_scale=k_scale, v_scale=v_scale):
        assert_close_for(got, want, torch.float32)
    _assert_counters_reset(batch.q.device)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_head_major_grid_matches_reference(num_splits: int) -> None:
    # The (Hkv, B, S) grid order: each program must still find its own sequence, KV head and
    # split counter (a swapped index would read another sequence's blocks or leave a counter).
    batch = _gqa4_batch([0, 5, 37, 11], torch.float32, seed=40 + num_splits)
    want = R.paged_decode_attention_ref(batch.q, batch.kv_cache, batch.block_tables,
                                        batch.seq_lens, 0.3)
    tiles = decode_mod.DecodeTiles(16, 1, 1, head_major=True)
    for _ in range(2):
        got = K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables,
                                       batch.seq_lens, 0.3, num_splits=num_splits, tiles=tiles)
        assert_close_for(got, want, torch.float32)
    if num_splits > 1:
        _assert_counters_reset(batch.q.device)


def test_decode_output_is_written_by_the_last_arriving_split_only() -> None:
    # A counter that does not start at zero shifts who is "last": with it at num_splits no
    # program sees num_splits - 1, so that (sequence, kv_head) group is never written. This is
    # why every launch must leave the counters at zero.
    batch = _gqa4_batch([9, 30], torch.float32, seed=6)
    want = R.paged_decode_attention_ref(batch.q, batch.kv_cache, batch.block_tables,
                                        batch.seq_lens, 0.3)
    counters = decode_mod.split_counters(batch.q.device, 4)
    counters[3] = 3  # sequence 1, kv_head 1
    try:
        out = torch.full_like(batch.q, float("nan"))
        K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                 0.3, out=out, num_splits=3)
        assert torch.isnan(out[1, 4:]).all()
        assert_close_for(out[0], want[0], torch.float32)
        assert_close_for(out[1, :4], want[1, :4], torch.float32)
        assert int(counters[3]) == 6 and int(counters[:3].abs().sum()) == 0
    finally:
        counters.zero_()


def test_split_counters_grow_and_keep_replaced_buffers_alive() -> None:
    device = torch.device("cpu")
    first = decode_mod.split_counters(device, 1)
    assert first.dtype == torch.int32 and first.numel() >= decode_mod.MIN_SPLIT_COUNTERS
    assert decode_mod.split_counters(device, first.numel()) is first
    bigger = decode_mod.split_counters(device, first.numel() + 1)
    assert bigger.numel() > first.numel() and not bigger.any()
    # A CUDA graph captured before the growth still points at the old buffer.
    assert any(t is first for t in decode_mod._retired_counters)
    assert decode_mod.split_counters(device, 1) is bigger  # never shrinks


# ----------------------------------------------------------------------------- prefill


@pytest.mark.parametrize(
    ("q_lens", "prefixes", "dtype", "block_size", "heads"),
    [
        ([20], [0], torch.float32, 4, (4, 2)),  # fresh prompt, two query tiles
        ([7, 1, 16, 1], [0, 23, 9, 0], torch.float32, 4, (4, 2)),  # prefix hits + decodes
        ([17, 5], [16, 35], torch.float16, 16, (4, 4)),  # chunked prefill, MHA
        ([9, 1, 3], [3, 12, 30], torch.bfloat16, 4, (4, 1)),  # MQA
    ],
)
def test_prefill_matches_reference_and_naive(
    q_lens: list[int], prefixes: list[int], dtype: torch.dtype, block_size: int,
    heads: tuple[int, int],
) -> None:
    seq_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    batch = make_batch(q_lens, seq_lens, num_heads=heads[0], num_kv_heads=heads[1],
                       block_size=block_size, dtype=dtype, seed=sum(q_lens) + block_size)
    out = torch.full_like(batch.q, float("nan"))
    K.paged_prefill_attention(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                              batch.block_tables, 0.18, max(q_lens), out=out)
    assert torch.isfinite(out).all(), "some output elements were never written"
    ref = R.paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                                batch.block_tables, 0.18)
    assert_close_for(out.float(), ref.float(), dtype)
    assert_close_for(out.double(), naive_attention(batch, 0.18), dtype)


def test_prefill_decode_rows_agree_with_decode_kernel() -> None:
    batch = decode_batch([4, 21, 37], block_size=4, seed=8)
    prefill = K.paged_prefill_attention(batch.q, batch.kv_cache, batch.query_start_loc,
                                        batch.seq_lens, batch.block_tables, 0.2, 1)
    decode = K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables,
                                      batch.seq_lens, 0.2, num_splits=3)
    torch.testing.assert_close(prefill, decode, atol=2e-5, rtol=2e-5)


# Speculative verification: several query tokens per sequence in the split decode kernel.


@pytest.mark.parametrize(
    "query_len, seq_lens, num_splits, dtype, heads",
    [
        (3, [3, 9, 40], 1, torch.float32, (8, 2)),
        # 33 = 2 x 16 + 1: with 3 splits of 16 positions over the 31 every token sees, the
        # last split takes the causal tail; 40 leaves empty trailing splits.
        (3, [33, 5, 40], 3, torch.float32, (8, 2)),
        (5, [5, 21, 64], 4, torch.float32, (4, 1)),   # 20 rows of 32: MQA, padded dot rows
        (5, [18, 37], 2, torch.bfloat16, (8, 2)),
        (4, [4, 30], 8, torch.float16, (4, 2)),
    ],
)
def test_decode_several_query_tokens_match_causal_prefill(
    query_len: int, seq_lens: list[int], num_splits: int, dtype: torch.dtype,
    heads: tuple[int, int],
) -> None:
    batch = make_batch([query_len] * len(seq_lens), seq_lens, num_heads=heads[0],
                       num_kv_heads=heads[1], head_dim=16, block_size=4, dtype=dtype,
                       seed=query_len * 31 + num_splits)
    want = R.paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                                 batch.block_tables, 0.3)
    out = torch.full_like(batch.q, float("nan"))
    for _ in range(2):  # twice: the split counters are reset for the next launch
        out.fill_(float("nan"))
        K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                 0.3, out=out, num_splits=num_splits, query_len=query_len)
        assert torch.isfinite(out).all(), "some output elements were never written"
        assert_close_for(out.float(), want.float(), dtype)
    assert_close_for(out.double(), naive_attention(batch, 0.3), dtype)
    if num_splits > 1:
        _assert_counters_reset(batch.q.device)


def test_decode_several_query_tokens_fp8_cache() -> None:
    batch = make_batch([4, 4], [4, 29], num_heads=8, num_kv_heads=2, head_dim=16, block_size=4,
                       seed=77)
    batch.kv_cache = (batch.kv_cache * 4).to(torch.float8_e4m3fn)
    k_scale, v_scale = 0.05, 2.0
    want = R.paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                                 batch.block_tables, 0.3, k_scale, v_scale)
    for n in (1, 3):
        got = K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables,
                                       batch.seq_lens, 0.3, num_splits=n, query_len=4,
                                       k_scale=k_scale, v_scale=v_scale)
        assert_close_for(got, want, torch.float32)


def test_decode_query_len_must_divide_the_tokens() -> None:
    batch = make_batch([3, 3], [3, 8], seed=5)
    with pytest.raises(KernelInputError, match="query_len"):
        K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                 0.3, query_len=4)
    with pytest.raises(KernelInputError, match="query_len"):
        K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                 0.3, query_len=0)


# ----------------------------------------------------------------------------- elementwise


def test_write_kv_matches_reference_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(2)
    kv_cache = torch.randn(2, 6, 4, 2, 16, generator=gen)
    before = kv_cache.clone()
    fused = torch.randn(5, 3 * 32 + 4, generator=gen)  # a padded token stride, like a QKV view
    key = fused[:, :32].view(5, 2, 16)
    value = fused[:, 32:64].view(5, 2, 16)
    slot_mapping = torch.tensor([22, -1, 0, 7, 23], dtype=torch.int64)
    want = kv_cache.clone()
    R.write_kv_ref(key, value, want, slot_mapping)
    K.write_kv(key, value, kv_cache, slot_mapping)
    assert torch.equal(kv_cache, want)
    # Independent check: each written slot holds its token, everything else is unchanged.
    written = {22: 0, 0: 2, 7: 3, 23: 4}
    for slot in range(24):
        block, offset = divmod(slot, 4)
        src = written.get(slot)
        exp_k = key[src] if src is not None else before[0, block, offset]
        exp_v = value[src] if src is not None else before[1, block, offset]
        assert torch.equal(kv_cache[0, block, offset], exp_k)
        assert torch.equal(kv_cache[1, block, offset], exp_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 48, generator=gen).to(dtype)  # hidden not a power of two
    w = torch.randn(48, generator=gen).to(dtype)
    res = torch.randn(2, 3, 48, generator=gen).to(dtype) if with_residual else None
    x_before = x.clone()
    got = K.rms_norm(x, w, 1e-5, res)
    want = R.rms_norm_ref(x, w, 1e-5, res)
    if with_residual:
        assert isinstance(got, tuple) and isinstance(want, tuple)
        assert_close_for(got[0], want[0], dtype)
        assert_close_for(got[1], want[1], dtype)
        assert res is not None
        # (the interpreter's bf16 rounding may differ from torch's by one ulp)
        assert_close_for(got[1], (x.float() + res.float()).to(dtype), dtype)
    else:
        assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
        assert_close_for(got, want, dtype)
    assert torch.equal(x, x_before), "inputs must not be mutated"


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_rotary_matches_reference(is_neox: bool, pos_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 3, 1, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + 1) * head_dim].view(num_tokens, 1, head_dim)
    v_before = qkv[:, (num_heads + 1) * head_dim:].clone()
    positions = torch.tensor([0, 7, 3, 19, 7], dtype=pos_dtype)
    cache = torch.randn(20, head_dim, generator=gen)
    q_ref, k_ref = q.clone(), k.clone()
    R.rotary_embedding_ref(positions, q_ref, k_ref, cache, is_neox=is_neox)
    K.rotary_embedding(positions, q, k, cache, is_neox=is_neox)
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, k_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, (num_heads + 1) * head_dim:], v_before), "V must be untouched"


def test_silu_and_mul_matches_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(3, 2 * 1100, generator=gen).to(dtype)  # spans two program blocks
        assert_close_for(K.silu_and_mul(x), R.silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize(("dtype", "block"), [(torch.float32, None), (torch.bfloat16, 512)])
def test_score_rows_matches_reference_and_a_naive_loop(dtype: torch.dtype,
                                                       block: int | None) -> None:
    """One pass per row (block 512: five blocks and a masked tail), rows of a padded tensor,
    equal maxima (the first wins, as torch.max), targets that are the max, the min, and ties."""
    gen = torch.Generator().manual_seed(9)
    wide = (3 * torch.randn(5, 2600, generator=gen)).to(dtype)
    logits = wide[:, :2500]  # row stride 2600
    logits[0, 10] = logits[0, 1500] = logits[0, 2300] = logits[0].max() + 1
    logits[1, 7] = logits[1, 8] = 0.5  # the target ties another token
    targets = torch.tensor([10, 7, int(logits[2].argmin()), 2499, 1234])
    got = K.score_rows(logits, targets, block=block)
    want = R.score_rows_ref(logits, targets)
    for g, w in zip(got, want, strict=True):
        if g.dtype == torch.int64:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    x = logits.double()
    for r in range(5):  # independently: a log-softmax in float64 and a count
        row = x[r]
        lse = row.exp().sum().log().item()
        t = int(targets[r])
        assert got[0][r].item() == pytest.approx(row[t].item() - lse, abs=1e-4)
        assert got[2][r].item() == pytest.approx(lse, abs=1e-4)
        assert int(got[1][r]) == sum(1 for v in row.tolist() if v > row[t].item()) + 1
        assert int(got[3][r]) == row.tolist().index(max(row.tolist()))
    assert int(got[3][0]) == 10 and int(got[1][0]) == 1


def test_score_rows_rejects_bad_inputs() -> None:
    x = torch.randn(3, 40)
    with pytest.raises(KernelInputError, match="targets"):
        K.score_rows(x, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(KernelInputError, match="targets"):
        K.score_rows(x, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(KernelInputError, match="dense"):
        K.score_rows(torch.randn(40, 3).t(), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(KernelInputError, match="power of two"):
        K.score_rows(x, torch.zeros(3, dtype=torch.int64), block=48)


# ----------------------------------------------------------------------------- validation


def _decode_args() -> dict[str, object]:
    batch = decode_batch([3, 5], block_size=4, seed=9)
    return {"q": batch.q, "kv_cache": batch.kv_cache, "block_tables": batch.block_tables,
            "seq_lens": batch.seq_lens, "scale": 0.2}


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("q", lambda a: a["q"].half(), "dtype"),
        ("q", lambda a: a["q"][:, :3], "num_heads"),
        ("q", lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2), "dense"),
        ("kv_cache", lambda a: a["kv_cache"].transpose(2, 3), "contiguous"),
        ("kv_cache", lambda a: a["kv_cache"][..., :24].contiguous(), "head_dim"),
        ("block_tables", lambda a: a["block_tables"].long(), "block_tables"),
        ("seq_lens", lambda a: a["seq_lens"][:1], "seq_lens"),
        ("scale", lambda a: -1.0, "scale"),
        ("num_splits", lambda a: 0, "num_splits"),
        ("out", lambda a: torch.empty(2, 4, 32, dtype=torch.float16), "out"),
    ],
)
def test_decode_rejects_bad_input(field: str, bad: object, message: str) -> None:
    args = _decode_args()
    args[field] = bad(args)  # type: ignore[operator]
    with pytest.raises(KernelInputError, match=message):
        K.paged_decode_attention(**args)  # type: ignore[arg-type]


def test_prefill_rejects_bad_input() -> None:
    batch = make_batch([3, 2], [3, 6], block_size=4)
    args = (batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
            0.2)
    with pytest.raises(KernelInputError, match="max_query_len"):
        K.paged_prefill_attention(*args, 0)
    with pytest.raises(KernelInputError, match="query_start_loc"):
        K.paged_prefill_attention(batch.q, batch.kv_cache, batch.query_start_loc[:2],
                                  batch.seq_lens, batch.block_tables, 0.2, 3)
    with pytest.raises(KernelInputError, match="num_heads"):
        K.paged_prefill_attention(batch.q[:, :3], *args[1:], 3)


def test_elementwise_reject_bad_input() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(KernelInputError, match="residual"):
        K.rms_norm(x, torch.ones(8), 1e-6, torch.randn(4, 8).double())
    with pytest.raises(KernelInputError, match="weight"):
        K.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(KernelInputError, match="contiguous"):
        K.rms_norm(x.t(), torch.ones(4), 1e-6)
    with pytest.raises(KernelInputError, match="even"):
        K.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(KernelInputError, match="cos_sin_cache"):
        K.rotary_embedding(torch.zeros(2, dtype=torch.int64), torch.randn(2, 2, 16),
                           torch.randn(2, 1, 16), torch.randn(10, 8))
    cache = torch.zeros(2, 3, 4, 1, 16)
    with pytest.raises(KernelInputError, match="slot_mapping"):
        K.write_kv(torch.randn(2, 1, 16), torch.randn(2, 1, 16), cache,
                   torch.zeros(2, dtype=torch.int32))
    with pytest.raises(KernelInputError, match="dtype"):
        K.write_kv(torch.randn(2, 1, 16).half(), torch.randn(2, 1, 16).half(), cache,
                   torch.zeros(2, dtype=torch.int64))


def test_cpu_tensors_without_interpreter_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelInputError, match="CUDA"):
        K.silu_and_mul(torch.randn(2, 8))


def test_triton_available_under_interpreter() -> None:
    assert K.triton_available()


def test_package_imports_without_triton() -> None:
    code = ("import sys; sys.modules['triton'] = None; import engine.kernels as k; "
            "assert not k.triton_available(); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# ----------------------------------------------------------------------------- fp8 KV cache

FP8 = torch.float8_e4m3fn


def _fp8_scales(kind: str) -> tuple[object, object]:
    if kind == "none":
        return None, None
    if kind == "float":
        return 0.05, 2.0
    return torch.tensor(0.05), torch.tensor([2.0])  # read by the kernel through a pointer


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scales", ["none", "float", "tensor"])
def test_write_kv_fp8_matches_reference_bitwise(src_dtype: torch.dtype, scales: str) -> None:
    """Quantize on store: x / scale, saturated at +-448, rounded to nearest even e4m3 (log-spread
    magnitudes cover subnormals, carries into the next binade, and saturation)."""
    gen = torch.Generator().manual_seed(5)
    magnitude = torch.exp2(torch.empty(24, 2, 16).uniform_(-14, 12, generator=gen))
    sign = torch.where(torch.rand(24, 2, 16, generator=gen) < 0.5, -1.0, 1.0)
    key = (magnitude * sign).to(src_dtype)
    value = torch.randn(24, 2, 16, generator=gen).to(src_dtype) * 3
    slot_mapping = torch.randperm(24, generator=gen)
    slot_mapping[5] = -1
    k_scale, v_scale = _fp8_scales(scales)
    got = torch.zeros(2, 6, 4, 2, 16, dtype=FP8)
    want = got.clone()
    K.write_kv(key, value, got, slot_mapping, k_scale, v_scale)  # type: ignore[arg-type]
    R.write_kv_ref(key, value, want, slot_mapping, k_scale, v_scale)  # type: ignore[arg-type]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got.float().abs().max() == 448.0


def _fp8_batch(q_lens: list[int], seq_lens: list[int], q_dtype: torch.dtype) -> PagedBatch:
    batch = make_batch(q_lens, seq_lens, seed=11)
    batch.q = batch.q.to(q_dtype)
    batch.kv_cache = (batch.kv_cache * 4).to(FP8)
    return batch


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scales", ["none", "float", "tensor"])
def test_decode_fp8_matches_dequantized_reference(q_dtype: torch.dtype, scales: str) -> None:
    batch = _fp8_batch([1, 1, 1], [5, 17, 30], q_dtype)
    k_scale, v_scale = _fp8_scales(scales)
    want = R.paged_decode_attention_ref(batch.q, batch.kv_cache, batch.block_tables,
                                        batch.seq_lens, 0.3, k_scale, v_scale)  # type: ignore[arg-type]
    for splits in (1, 3):
        got = K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables,
                                       batch.seq_lens, 0.3, num_splits=splits,
                                       k_scale=k_scale, v_scale=v_scale)  # type: ignore[arg-type]
        assert got.dtype == q_dtype
        assert_close_for(got, want, q_dtype)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scales", ["float", "tensor"])
def test_prefill_fp8_matches_dequantized_reference(q_dtype: torch.dtype, scales: str) -> None:
    batch = _fp8_batch([7, 1, 12], [7, 20, 30], q_dtype)
    k_scale, v_scale = _fp8_scales(scales)
    want = R.paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                                 batch.block_tables, 0.3, k_scale, v_scale)  # type: ignore[arg-type]
    got = K.paged_prefill_attention(batch.q, batch.kv_cache, batch.query_start_loc,
                                    batch.seq_lens, batch.block_tables, 0.3, 12,
                                    k_scale=k_scale, v_scale=v_scale)  # type: ignore[arg-type]
    assert_close_for(got, want, q_dtype)
    # The scale is applied: without it the output differs.
    plain = K.paged_prefill_attention(batch.q, batch.kv_cache, batch.query_start_loc,
                                      batch.seq_lens, batch.block_tables, 0.3, 12)
    assert not torch.allclose(plain.float(), got.float(), atol=0.1)


def test_fp8_cache_with_16_bit_q_takes_the_fp16_dot_path() -> None:
    """The dispatch the tests above rely on: bf16/fp16 q over an fp8 cache run fp16 dots (which
    the interpreter computes correctly, so they are not upcast here); fp32 q and non-fp8 caches
    keep their dots in q's dtype."""
    for q_dtype in (torch.bfloat16, torch.float16):
        assert tile_dots(q_dtype, FP8) == TileDots(f16=True, precision="tf32", upcast=False)
    assert tile_dots(torch.float32, FP8) == TileDots(f16=False, precision="ieee", upcast=False)
    assert tile_dots(torch.bfloat16, torch.bfloat16) == TileDots(False, "ieee", upcast=True)
    assert tile_dots(torch.float16, torch.float16) == TileDots(False, "tf32", upcast=False)


def test_fp8_register_conversion_falls_back_where_it_cannot_compile() -> None:
    """The inline-asm conversion (`KvCvt.V_REGS` / `KV_REGS`) needs an sm_89+ GPU. On the CPU,
    and without a device, the dot choice keeps Triton's own conversion, so a decode launched
    with such tiles still runs (the interpreter has no inline asm) and matches the reference."""
    cpu = torch.device("cpu")
    assert not kv_cvt_supported(cpu)
    for cvt in KvCvt:
        assert tile_dots(torch.bfloat16, FP8, cvt, cpu).kv_cvt == KvCvt.OPERAND
        assert tile_dots(torch.bfloat16, FP8, cvt).kv_cvt == KvCvt.OPERAND
    batch = _fp8_batch([1, 1], [5, 30], torch.bfloat16)
    want = R.paged_decode_attention_ref(batch.q, batch.kv_cache, batch.block_tables,
                                        batch.seq_lens, 0.3)
    tiles = decode_mod.DecodeTiles(16, 1, 1, kv_cvt=KvCvt.KV_REGS)
    got = K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                   0.3, tiles=tiles)
    assert_close_for(got, want, torch.bfloat16)


def test_fp8_large_query_does_not_overflow_the_fp16_path() -> None:
    """bf16 q beyond fp16's range (65504): casting it to fp16 would give inf, but the kernels
    scale it by softmax scale * log2(e) * k_scale first, which brings it back to O(1). The small
    k_scale keeps the scores (and so the softmax) moderate, so errors in them would show."""
    k_scale, v_scale = 2e-5, 2.0
    decode = _fp8_batch([1, 1, 1], [5, 17, 30], torch.bfloat16)
    prefill = _fp8_batch([7, 1, 12], [7, 20, 30], torch.bfloat16)
    for batch in (decode, prefill):
        batch.q = (batch.q.float() * 3e4).to(torch.bfloat16)
        assert batch.q.float().abs().max() > torch.finfo(torch.float16).max
    want = R.paged_decode_attention_ref(decode.q, decode.kv_cache, decode.block_tables,
                                        decode.seq_lens, 0.3, k_scale, v_scale)
    for splits in (1, 3):
        got = K.paged_decode_attention(decode.q, decode.kv_cache, decode.block_tables,
                                       decode.seq_lens, 0.3, num_splits=splits,
                                       k_scale=k_scale, v_scale=v_scale)
        assert torch.isfinite(got).all()
        assert_close_for(got, want, torch.bfloat16)
    want = R.paged_attention_ref(prefill.q, prefill.kv_cache, prefill.query_start_loc,
                                 prefill.seq_lens, prefill.block_tables, 0.3, k_scale, v_scale)
    got = K.paged_prefill_attention(prefill.q, prefill.kv_cache, prefill.query_start_loc,
                                    prefill.seq_lens, prefill.block_tables, 0.3, 12,
                                    k_scale=k_scale, v_scale=v_scale)
    assert torch.isfinite(got).all()
    assert_close_for(got, want, torch.bfloat16)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_decode_fp8_one_and_three_splits_agree(q_dtype: torch.dtype) -> None:
    """Split-K over an fp8 cache (per-split V scale, last-arriver combine) vs one split: several
    KV tiles per split, and a sequence shorter than the split count (empty splits). float32 q
    keeps exact fp32 dots, so the two agree with each other and the reference to fp32 rounding;
    bf16 q runs the fp16 path."""
    batch = make_batch([1, 1, 1], [3, 40, 64], seed=12)
    batch.q = batch.q.to(q_dtype)
    batch.kv_cache = (batch.kv_cache * 4).to(FP8)
    k_scale, v_scale = torch.tensor(0.05), torch.tensor(2.0)
    want = R.paged_decode_attention_ref(batch.q, batch.kv_cache, batch.block_tables,
                                        batch.seq_lens, 0.3, k_scale, v_scale)
    one, three = (K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables,
                                           batch.seq_lens, 0.3, num_splits=splits,
                                           k_scale=k_scale, v_scale=v_scale)
                  for splits in (1, 3))
    assert_close_for(one, want, q_dtype)
    assert_close_for(three, want, q_dtype)
    assert_close_for(three, one, q_dtype)


def test_fp8_inputs_are_validated() -> None:
    batch = _fp8_batch([1, 1], [3, 5], torch.float32)
    args = (batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, 0.2)
    with pytest.raises(KernelInputError, match=r"q has dtype torch\.float64"):
        K.paged_decode_attention(batch.q.double(), *args[1:])
    with pytest.raises(KernelInputError, match="k_scale must be a float32 tensor of one element"):
        K.paged_decode_attention(*args, k_scale=torch.ones(2), v_scale=torch.ones(1))
    with pytest.raises(KernelInputError, match="v_scale must be positive"):
        K.paged_decode_attention(*args, k_scale=1.0, v_scale=0.0)
    with pytest.raises(KernelInputError, match="both be floats or both be tensors"):
        K.paged_decode_attention(*args, k_scale=1.0, v_scale=torch.ones(1))
    plain = make_batch([1, 1], [3, 5])  # float32 cache: q must match it, and no scales
    with pytest.raises(KernelInputError, match="only an fp8 or int8 kv_cache takes another dtype"):
        K.paged_decode_attention(plain.q.half(), plain.kv_cache, plain.block_tables,
                                 plain.seq_lens, 0.2)
    with pytest.raises(KernelInputError, match="k_scale is only allowed with an fp8 or int8 kv_cache"):
        K.write_kv(plain.q[:, :2], plain.q[:, :2], plain.kv_cache,
                   torch.tensor([0, 1]), k_scale=0.5, v_scale=0.5)


# ----------------------------------------------------------------------------- int8 KV cache

INT8 = torch.int8


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", ["float", "tensor"])
def test_write_kv_int8_matches_reference_bitwise(src_dtype: torch.dtype, scales: str) -> None:
    """Quantize on store: x / scale, saturated at +-127, rounded to the nearest integer with
    halves away from zero (exact halves included), against the reference's own formulation."""
    gen = torch.Generator().manual_seed(6)
    key = (torch.randn(24, 2, 16, generator=gen) * 4).to(src_dtype)
    value = (torch.randn(24, 2, 16, generator=gen) * 3).to(src_dtype)
    slot_mapping = torch.randperm(24, generator=gen)
    slot_mapping[7] = -1
    k_scale, v_scale = (0.05, 2.0) if scales == "float" else (torch.tensor(0.05),
                                                              torch.tensor([2.0]))
    got = torch.zeros(2, 6, 4, 2, 16, dtype=INT8)
    want = got.clone()
    K.write_kv(key, value, got, slot_mapping, k_scale, v_scale)
    R.write_kv_ref(key, value, want, slot_mapping, k_scale, v_scale)
    assert torch.equal(got, want)
    assert got[0].abs().max() == 127 and got.min() >= -127  # saturated, never -128
    # Exact halves (scale 0.5: x / scale is exact) round away from zero.
    halves = torch.zeros(1, 1, 16)
    halves[0, 0, :6] = torch.tensor([0.25, -0.25, 0.75, -1.25, 0.0, 63.75])
    cache = torch.zeros(2, 1, 4, 1, 16, dtype=INT8)
    K.write_kv(halves, halves, cache, torch.tensor([2]), 0.5, 0.5)
    assert cache[0, 0, 2, 0, :6].tolist() == [1, -1, 2, -3, 0, 127]


def _int8_batch(q_lens: list[int], seq_lens: list[int], q_dtype: torch.dtype, seed: int = 13,
                **shape: Any) -> PagedBatch:
    """`make_batch` with q in `q_dtype` and its cache as int8 (N(0, 1) / 0.025, rounded)."""
    batch = make_batch(q_lens, seq_lens, seed=seed, **shape)
    batch.q = batch.q.to(q_dtype)
    batch.kv_cache = (batch.kv_cache * 40).round().clamp(-127, 127).to(INT8)
    return batch


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qk_int8", [False, True], ids=["fp16-qk", "int8-qk"])
def test_decode_int8_matches_dequantized_reference(q_dtype: torch.dtype, qk_int8: bool) -> None:
    """Through the fp16 QK path within q's own tolerance; with the int8 QK dot (16-bit q only;
    fp32 q keeps exact fp32 dots) within bf16's, q's int8 rounding being the larger error."""
    batch = _int8_batch([1, 1, 1], [5, 17, 30], q_dtype)
    k_scale, v_scale = 0.025, 0.02
    want = R.paged_decode_attention_ref(batch.q, batch.kv_cache, batch.block_tables,
                                        batch.seq_lens, 0.3, k_scale, v_scale)
    tiles = decode_mod.DecodeTiles(16, 1, 1, qk_int8=qk_int8)
    tolerance = torch.bfloat16 if qk_int8 and q_dtype != torch.float32 else q_dtype
    for splits in (1, 3):
        got = K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables,
                                       batch.seq_lens, 0.3, num_splits=splits,
                                       k_scale=k_scale, v_scale=v_scale, tiles=tiles)
        assert got.dtype == q_dtype
        assert_close_for(got, want, tolerance)
    # The scales are applied: without them the output differs.
    plain = K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables,
                                     batch.seq_lens, 0.3, tiles=tiles)
    assert not torch.allclose(plain.float(), want.float(), atol=0.1)


def test_decode_several_query_tokens_int8_cache() -> None:
    batch = _int8_batch([4, 4], [4, 29], torch.bfloat16, seed=78, num_heads=8, num_kv_heads=2,
                        head_dim=16, block_size=4)
    want = R.paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                                 batch.block_tables, 0.3, 0.025, 0.02)
    for n in (1, 3):
        got = K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables,
                                       batch.seq_lens, 0.3, num_splits=n, query_len=4,
                                       k_scale=0.025, v_scale=0.02)
        assert_close_for(got, want, torch.bfloat16)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_prefill_int8_matches_dequantized_reference(q_dtype: torch.dtype) -> None:
    batch = _int8_batch([7, 1, 12], [7, 20, 30], q_dtype)
    k_scale, v_scale = torch.tensor(0.025), torch.tensor([0.02])
    want = R.paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                                 batch.block_tables, 0.3, k_scale, v_scale)
    got = K.paged_prefill_attention(batch.q, batch.kv_cache, batch.query_start_loc,
                                    batch.seq_lens, batch.block_tables, 0.3, 12,
                                    k_scale=k_scale, v_scale=v_scale)
    assert_close_for(got, want, q_dtype)


@pytest.mark.parametrize("kv_cvt", [KvCvt.OPERAND, KvCvt.V_REGS])
def test_decode_int8_qk_dot_matches_dequantized_reference(kv_cvt: KvCvt) -> None:
    """`DecodeTiles.qk_int8`: q quantized per row to int8 and the QK dot on int8 (exact integer
    products); the only added error is q's rounding, within the bf16 tolerance. Split and
    several-token (verify) launches too."""
    batch = _int8_batch([1, 1, 1], [5, 17, 30], torch.bfloat16)
    want = R.paged_decode_attention_ref(batch.q, batch.kv_cache, batch.block_tables,
                                        batch.seq_lens, 0.3, 0.025, 0.02)
    tiles = decode_mod.DecodeTiles(16, 1, 1, kv_cvt=kv_cvt, qk_int8=True)
    for splits in (1, 3):
        got = K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables,
                                       batch.seq_lens, 0.3, num_splits=splits, k_scale=0.025,
                                       v_scale=0.02, tiles=tiles)
        assert_close_for(got, want, torch.bfloat16)
    multi = _int8_batch([4, 4], [4, 29], torch.bfloat16, seed=79, num_heads=8, num_kv_heads=2,
                        head_dim=16, block_size=4)
    want = R.paged_attention_ref(multi.q, multi.kv_cache, multi.query_start_loc, multi.seq_lens,
                                 multi.block_tables, 0.3, 0.025, 0.02)
    got = K.paged_decode_attention(multi.q, multi.kv_cache, multi.block_tables, multi.seq_lens,
                                   0.3, num_splits=2, query_len=4, k_scale=0.025, v_scale=0.02,
                                   tiles=tiles)
    assert_close_for(got, want, torch.bfloat16)


def test_int8_cache_takes_the_fp16_dot_path_and_falls_back_on_the_cpu() -> None:
    """bf16/fp16 q over an int8 cache run fp16 dots like fp8 (int8 values are exact in fp16);
    the in-register conversion (`s8x4_to_f16`, inline asm) is for CUDA devices only."""
    for q_dtype in (torch.bfloat16, torch.float16):
        assert tile_dots(q_dtype, INT8) == TileDots(f16=True, precision="tf32", upcast=False)
    assert tile_dots(torch.float32, INT8) == TileDots(f16=False, precision="ieee", upcast=False)
    cpu = torch.device("cpu")
    assert not kv_cvt_supported(cpu, INT8)
    assert tile_dots(torch.bfloat16, INT8, KvCvt.V_REGS, cpu).kv_cvt == KvCvt.OPERAND
    assert decode_mod.choose_decode_tiles(128, INT8).qk_int8  # the int8 QK dot (measured faster)


def test_int8_qk_dot_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPLITSERVE_INT8_QK=0: int8 caches take fp8's tiles and the fp16 QK path; bad values
    are named."""
    try:
        monkeypatch.setenv("SPLITSERVE_INT8_QK", "0")
        decode_mod.int8_qk_requested.cache_clear()
        assert not decode_mod.choose_decode_tiles(128, INT8).qk_int8
        monkeypatch.setenv("SPLITSERVE_INT8_QK", "yes")
        decode_mod.int8_qk_requested.cache_clear()
        with pytest.raises(KernelInputError, match="SPLITSERVE_INT8_QK must be 0 or 1"):
            decode_mod.choose_decode_tiles(128, INT8)
    finally:
        monkeypatch.delenv("SPLITSERVE_INT8_QK")
        decode_mod.int8_qk_requested.cache_clear()
    assert decode_mod.choose_decode_tiles(128, INT8).qk_int8


def test_verify_steps_split_less_than_decodes() -> None:
    choose = K.choose_num_splits
    assert choose(1, 8, 131072, 132, query_len=5) == 17  # ~one program per SM
    assert choose(1, 8, 131072, 132) == 32  # decoding: ~four (capped)
    assert choose(16, 8, 131072, 132, query_len=5) == 2
    assert choose(64, 8, 131072, 132, query_len=5) == 1
