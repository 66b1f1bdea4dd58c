"""Sliding-window attention and attention-logit soft-capping in the paged Triton kernels
(TRITON_INTERPRET=1, CPU), against the torch references and the independent naive loop.

Windows shorter and longer than the KV tiles (16 positions under the interpreter) and than the
query tiles, split decode with splits that see nothing of some rows' windows, verify steps whose
tokens' windows start at different positions, chunked prefills and prefix hits, quantized caches.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.kernels.test_kernels import assert_close_for, decode_batch, make_batch, naive_attention
from tests.support.interpret import interpret_or_skip, interpreted_kernel_imports

with interpreted_kernel_imports():
    from engine import kernels as K
    from engine.kernels import decode_attention as decode_mod
    from engine.kernels import reference as R
    from engine.kernels._checks import KernelInputError


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    interpret_or_skip(monkeypatch, decode_mod._decode_split_kernel)
    yield


def test_reference_window_and_softcap_match_naive() -> None:
    batch = make_batch([6, 1, 9], [6, 30, 21], seed=5)
    for window, softcap in ((4, 0.0), (0, 2.0), (7, 1.5)):
        ref = R.paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc,
                                    batch.seq_lens, batch.block_tables, 0.3,
                                    sliding_window=window, logit_softcap=softcap)
        torch.testing.assert_close(ref.double(), naive_attention(batch, 0.3, window, softcap),
                                   atol=1e-5, rtol=1e-5)
    # The window bites: without it the result differs.
    full = R.paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc,
                                 batch.seq_lens, batch.block_tables, 0.3)
    windowed = R.paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc,
                                     batch.seq_lens, batch.block_tables, 0.3, sliding_window=4)
    assert not torch.allclose(full, windowed, atol=1e-3)


@pytest.mark.parametrize(
    ("window", "softcap", "num_splits", "dtype"),
    [
        (5, 0.0, 1, torch.float32),     # window inside one KV tile
        (5, 0.0, 3, torch.float32),     # split over 5 positions: some splits empty
        (21, 0.0, 4, torch.float32),    # window across tiles, splits inside it
        (100, 0.0, 2, torch.float32),   # window longer than every sequence: plain attention
        (0, 3.0, 3, torch.float32),     # soft cap only
        (9, 2.5, 2, torch.bfloat16),    # both
    ],
)
def test_decode_window_and_softcap(window: int, softcap: float, num_splits: int,
                                   dtype: torch.dtype) -> None:
    batch = decode_batch([1, 6, 19, 40], block_size=4, dtype=dtype, seed=window + num_splits)
    out = torch.full_like(batch.q, float("nan"))
    for _ in range(2):  # twice: the split counters are left at zero by the first launch
        out.fill_(float("nan"))
        K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                 0.25, out=out, num_splits=num_splits, sliding_window=window,
                                 logit_softcap=softcap)
        assert torch.isfinite(out).all(), "some output elements were never written"
    ref = R.paged_decode_attention_ref(batch.q, batch.kv_cache, batch.block_tables,
                                       batch.seq_lens, 0.25, sliding_window=window,
                                       logit_softcap=softcap)
    assert_close_for(out.float(), ref.float(), dtype)
    assert_close_for(out.double(), naive_attention(batch, 0.25, window, softcap), dtype)


@pytest.mark.parametrize(("query_len", "window", "num_splits"),
                         [(3, 4, 1), (3, 4, 3), (5, 2, 2), (4, 17, 4)])
def test_decode_several_query_tokens_with_a_window(query_len: int, window: int,
                                                   num_splits: int) -> None:
    # Each verify token's window starts one position later than the previous token's.
    batch = make_batch([query_len] * 3, [query_len, 14, 37], num_heads=8, num_kv_heads=2,
                       head_dim=16, block_size=4, seed=query_len * 13 + window)
    out = K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                   0.3, num_splits=num_splits, query_len=query_len,
                                   sliding_window=window, logit_softcap=4.0)
    assert torch.isfinite(out).all()
    assert_close_for(out.double(), naive_attention(batch, 0.3, window, 4.0), torch.float32)


@pytest.mark.parametrize(
    ("q_lens", "prefixes", "window", "softcap", "dtype"),
    [
        ([40], [0], 5, 0.0, torch.float32),          # fresh prompt, three query tiles
        ([40], [0], 21, 0.0, torch.float32),         # window wider than a query tile
        ([7, 1, 16, 1], [0, 23, 9, 30], 6, 0.0, torch.float32),  # prefix hits + decodes
        ([17, 5], [16, 35], 12, 3.0, torch.float16),  # chunked prefill, window + soft cap
        ([9, 1, 3], [3, 12, 30], 0, 2.0, torch.bfloat16),  # soft cap only
    ],
)
def test_prefill_window_and_softcap(q_lens: list[int], prefixes: list[int], window: int,
                                    softcap: float, dtype: torch.dtype) -> None:
    seq_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    batch = make_batch(q_lens, seq_lens, block_size=4, dtype=dtype, seed=window + sum(q_lens))
    out = torch.full_like(batch.q, float("nan"))
    K.paged_prefill_attention(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                              batch.block_tables, 0.18, max(q_lens), out=out,
                              sliding_window=window, logit_softcap=softcap)
    assert torch.isfinite(out).all(), "some output elements were never written"
    ref = R.paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                                batch.block_tables, 0.18, sliding_window=window,
                                logit_softcap=softcap)
    assert_close_for(out.float(), ref.float(), dtype)
    assert_close_for(out.double(), naive_attention(batch, 0.18, window, softcap), dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantized_caches_with_a_window_and_softcap(kv_dtype: torch.dtype) -> None:
    batch = make_batch([1, 1, 5], [9, 33, 20], block_size=4, seed=21)
    if kv_dtype == torch.int8:
        batch.kv_cache = (batch.kv_cache * 40).round().clamp(-127, 127).to(torch.int8)
    else:
        batch.kv_cache = (batch.kv_cache * 4).to(torch.float8_e4m3fn)
    ks, vs = 0.05, 0.5
    want = R.paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                                 batch.block_tables, 0.3, ks, vs, sliding_window=7,
                                 logit_softcap=2.0)
    got = K.paged_prefill_attention(batch.q, batch.kv_cache, batch.query_start_loc,
                                    batch.seq_lens, batch.block_tables, 0.3, 5, k_scale=ks,
                                    v_scale=vs, sliding_window=7, logit_softcap=2.0)
    assert_close_for(got, want, torch.float32)
    decodes = slice(0, 2)
    got = K.paged_decode_attention(batch.q[decodes], batch.kv_cache, batch.block_tables[decodes],
                                   batch.seq_lens[decodes], 0.3, num_splits=2, k_scale=ks,
                                   v_scale=vs, sliding_window=7, logit_softcap=2.0)
    assert_close_for(got, want[decodes], torch.float32)


@pytest.mark.parametrize(("field", "bad"), [("sliding_window", -1), ("sliding_window", 2.0),
                                            ("logit_softcap", -1.0),
                                            ("logit_softcap", float("nan")),
                                            ("logit_softcap", float("inf"))])
def test_bad_window_or_softcap_is_refused(field: str, bad: object) -> None:
    batch = decode_batch([4, 9], block_size=4, seed=1)
    with pytest.raises(KernelInputError, match=field):
        K.paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                 0.2, **{field: bad})  # type: ignore[arg-type]
    with pytest.raises(KernelInputError, match=field):
        K.paged_prefill_attention(batch.q, batch.kv_cache, batch.query_start_loc,
                                  batch.seq_lens, batch.block_tables, 0.2, 1,
                                  **{field: bad})  # type: ignore[arg-type]
